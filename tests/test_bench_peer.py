"""`make bench-peer`'s parts that need no vLLM: its workloads and requests, ours' serve config, the report."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import yaml
from PIL import Image

from bench.peer import build_requests, parse_args
from bench.peer_report import WORKLOADS, prompt_check, ratio_lines, ratios, system_table
from bench.peer_servers import ROOT
from demo.local import ingress_of, ingress_ports, ours_config, serve_env


@pytest.fixture(scope="module")
def tokenizer():
    from demo.build_tiny import build_tokenizer

    return build_tokenizer()


def test_workloads_are_issue_18s():
    assert [w.label for w in WORKLOADS] == ["1 image 224x224, 64 out",
                                            "3 images (224x224, 160x112, 96x96), 64 out",
                                            "1 image 112x112, 256 out"]  # fmt: skip


def test_requests_carry_exactly_the_workloads_images_and_lengths(tokenizer):
    args = parse_args(["--num-prompts", "5", "--num-prompts-c1", "2", "--warmup", "1", "--input-len", "16"])
    sets = build_requests(args, tokenizer)
    assert list(sets) == ["a", "b", "c"]
    for w in WORKLOADS:
        runs = sets[w.key]
        assert [len(runs[k]) for k in ("warmup", "hi", "lo")] == [1, 5, 2]
        everything = runs["warmup"] + runs["hi"] + runs["lo"]
        assert len({r.index for r in everything}) == 8  # disjoint: no run sees another's prompt
        for r in everything:
            assert r.image_sizes == list(w.sizes) and r.output_len == w.output_len and r.text_tokens == 16
            assert [Image.open(io.BytesIO(png)).size for png in r.images] == list(w.sizes)
    # the workloads differ from each other, and the same flags give the same requests
    assert sets["a"]["hi"][0].text != sets["c"]["hi"][0].text
    again = build_requests(args, tokenizer)
    assert [r.images for r in again["b"]["lo"]] == [r.images for r in sets["b"]["lo"]]


def test_quick_caps_output_and_picks_workloads(tokenizer):
    args = parse_args(["--quick", "--workloads", "c", "--num-prompts", "3"])
    assert (args.concurrency, args.num_prompts, args.num_prompts_c1) == (4, 3, 2)
    sets = build_requests(args, tokenizer)
    assert list(sets) == ["c"] and {r.output_len for r in sets["c"]["hi"]} == {16}


def test_ours_config_is_serve_configs_with_checkpoint_and_port_only(tmp_path):
    base = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config, changes = ours_config(tmp_path / "ckpt", 12345, {})
    assert config["applications"][0]["deployments"] == base["applications"][0]["deployments"]
    assert config["applications"][0]["args"] == {**base["applications"][0]["args"], "model": str(tmp_path / "ckpt")}
    assert config["http_options"]["port"] == 12345 and config["proxy_location"] == base["proxy_location"]
    assert any("args.model" in c for c in changes) and any("port" in c for c in changes)
    merged, changes = ours_config(Path("x"), 1, {"llm": {"stream_interval_ms": 50}})
    llm = merged["applications"][0]["args"]["llm"]
    assert llm["stream_interval_ms"] == 50 and llm["max_queued_requests"] == 64  # merged, not replaced
    assert any("--app-args" in c for c in changes)
    assert not base["applications"][0]["args"]["encoder"]["colocated"]  # the laptop's layout: the tier
    pinned, changes = ours_config(Path("x"), 1, {}, {"Encoder": {"num_replicas": 1}})
    (encoder,) = [d for d in pinned["applications"][0]["deployments"] if d["name"] == "Encoder"]
    assert encoder["num_replicas"] == 1 and encoder["ray_actor_options"] == {"num_cpus": 0.4}  # merged
    assert any("Encoder" in c and "merged" in c for c in changes)
    alone, changes = ours_config(Path("x"), 1, {"encoder": {"colocated": True}})
    app = alone["applications"][0]
    assert app["args"]["encoder"]["colocated"] and app["args"]["encoder"]["cache_gib"] == 0.5
    assert [d["name"] for d in app["deployments"]] == ["Ingress", "LLM"]  # Serve refuses an entry the app lacks
    assert any("Encoder" in c and "removed" in c for c in changes)
    added, changes = ours_config(Path("x"), 1, {}, {"Probe": {"num_replicas": 1}})
    assert {"name": "Probe", "num_replicas": 1} in added["applications"][0]["deployments"]
    assert any("Probe" in c and "added" in c for c in changes)
    again, changes = ours_config(Path("x"), 1, {}, {"LLM": {"ray_actor_options": {"num_cpus": 2}}})
    (llm,) = [d for d in again["applications"][0]["deployments"] if d["name"] == "LLM"]
    assert llm["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0} and llm["autoscaling_config"]["max_replicas"] == 1
    assert any("LLM" in c and "merged" in c for c in changes)


def test_front_doors_are_the_makefiles():
    workers = {"RAY_worker_niceness": "0", "RAY_preload_python_modules": "torch"}  # nice 0; torch in idle workers
    assert serve_env("proxy") == workers and ingress_of(serve_env("proxy")) == "proxy"
    assert all(serve_env(door)["RAY_worker_niceness"] == "0" for door in ("direct", "haproxy"))  # replicas at nice 0
    assert serve_env("direct")["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1" and ingress_of(serve_env("direct")) == "direct"
    assert serve_env("haproxy")["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and ingress_of(serve_env("haproxy")) == "haproxy"
    assert ingress_of(serve_env()) == "direct"  # `make serve`'s default (README "Front door" says why)
    assert ingress_ports("proxy", 1234) == (1234, {}, [])
    port, env, why = ingress_ports("direct", 1234)  # clients talk to the Ingress replica's own, pinned port
    assert port != 1234 and env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == str(port) and len(why) == 2
    assert env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] == str(port + 1)
    port, env, _ = ingress_ports("haproxy", 1234)  # clients talk to HAProxy; its side ports move off the fixed ones
    assert port == 1234 and {"RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"} <= set(env)
    args = parse_args(["--ingress", "direct", "--ours-env", "A=1", "--ours-env", "B=x=y"])
    assert args.ingress == "direct" and args.ours_env == {"A": "1", "B": "x=y"}
    with pytest.raises(SystemExit):
        parse_args(["--ours-env", "novalue"])


def _agg(tok_s: float, tpot: tuple[float, float], ttft: float, failed: int = 0) -> dict:
    return {
        "out_tok_per_s": tok_s,
        "tpot_ms": {"p50": tpot[0], "p99": tpot[1]},
        "ttft_ms": {"p50": ttft},
        "errors": {"HTTP 503: busy": failed} if failed else {},
        "warnings": [],
        "short_outputs": 0,
    }


def _results() -> dict:
    ours = {w.key: {32: _agg(300, (80, 110), 2000), 1: _agg(60, (15, 16), 100)} for w in WORKLOADS}
    peer = {w.key: {32: _agg(200, (40, 70), 2500), 1: _agg(80, (12, 13), 90)} for w in WORKLOADS}
    peer["c"][32] = _agg(600, (40, 50), 1000, failed=2)
    return {"ours": ours, "vllm": peer}


def test_tables_and_ratios():
    results = _results()
    table = system_table(results["vllm"], list(WORKLOADS), 32, 1)
    assert table[0] == "| workload | c=32 output tok/s | c=1 tok/s | c=32 TPOT p50/p99 ms | c=32 TTFT p50 ms |"
    assert table[2] == "| 1 image 224x224, 64 out | 200 | 80 | 40 / 70 | 2500 |"
    assert table[-1] == "  c c=32: 2 x HTTP 503: busy"
    r = ratios(results, list(WORKLOADS), 32, 1)
    assert r["a"] == pytest.approx({"tok_s_hi": 1.5, "tpot_p50_lo": 1.25, "ttft_p50_hi": 0.8})
    lines = ratio_lines(r, list(WORKLOADS), 32, 1)
    assert lines[-1] == (
        "peer: c=32 tok/s ours/vLLM = 1.50x, 1.50x, 0.50x; c=1 TPOT ours/vLLM = 1.25x, 1.25x, 1.25x; "
        "c=32 TTFT p50 ours/vLLM = 0.80x, 0.80x, 2.00x"
    )
    missing = ratios({"ours": results["ours"], "vllm": {}}, list(WORKLOADS), 32, 1)
    assert ratio_lines(missing, list(WORKLOADS), 32, 1)[-1].startswith("peer: c=32 tok/s ours/vLLM = -, -, -;")


def test_prompt_check_names_mismatches():
    def recs(tokens: list[int]) -> dict:
        return {
            w.key: {32: [{"index": i, "ok": True, "prompt_tokens": t} for i, t in enumerate(tokens)]} for w in WORKLOADS
        }

    ok, text = prompt_check({"ours": recs([150, 150]), "vllm": recs([150, 150])}, list(WORKLOADS))
    assert ok and text.startswith("prompt tokens (usage.prompt_tokens) equal for both systems: a: 2/2 equal (150")
    ok, text = prompt_check({"ours": recs([150, 151]), "vllm": recs([150, 150])}, list(WORKLOADS))
    assert not ok and "(32, 1): (151, 150)" in text
    ok, _ = prompt_check({"ours": recs([150]), "vllm": {}}, list(WORKLOADS))
    assert not ok  # nothing compared is no proof
