#!/usr/bin/env bash
# Issue 19's GPU checks in one run, on a GPU machine whose python3 holds torch, triton and transformers (a lent
# machine of this project: `bash bench/gpu.sh`, logs into $OUT, else bench_results/gpu). What that machine lacks
# (pydantic, xgrammar and our transformers pin; Ray is not needed) travels as wheels in .whl/ (bench/README.md):
#   1. bench.gpu_decode: cuda float32 greedy == cpu (eager, static step, CUDA graphs); decode steps/s against the
#      bandwidth bound for batch 1-64, eager and graphs; launches, kernels and GPU time per step (torch profiler)
#   2. the `gpu`-marked tests: the Triton paged-attention kernel against its reference, graph replay, the engine
#      and encoders on cuda
#   3. bench.gpu_encoder: ViT images/s and MFU at 448x448 and 1344x1344
# Each part has its own time limit, so one that hangs or fails leaves the others their time.
set -u
OUT=${OUT:-bench_results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
{
    echo "commit ${REV:-$(git rev-parse --short HEAD 2> /dev/null)}, $(date -u '+%F %H:%M UTC')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import sys, torch; from importlib.metadata import version as v
print(sys.version.split()[0], *(f'{p} {v(p)}' for p in ('torch', 'triton', 'transformers', 'xgrammar', 'pydantic')))"
    nproc
} 2>&1 | tee "$OUT/env.txt"
# The CPU side of the checks uses llm/model/cpu_kernels.cpp: build it while the GPU works (its flock serialises).
# CPU_KERNELS=0 leaves it out: the build's compilers take the cores the host's side of a timed decode step needs (at
# 74b37ff a batch-8 step measured 2.63 ms beside the build, 1.97 ms after it).
[ "${CPU_KERNELS:-1}" = 1 ] && python3 -c "from llm.model import cpu_kernels; cpu_kernels.load()" > "$OUT/cpu_kernels.log" 2>&1 &
# A part whose limit is 0 is left out; DECODE_ARGS and TESTS pick what runs of the first two.
[ "${DECODE_S:-300}" -gt 0 ] && timeout "${DECODE_S:-300}" python3 -m bench.gpu_decode ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode.md"
[ "${TESTS_S:-120}" -gt 0 ] && timeout "${TESTS_S:-120}" python3 -m pytest -m gpu -q -p no:cacheprovider ${TESTS:-tests/llm/test_triton_attention.py \
    tests/llm/test_triton_fused.py tests/llm/test_engine.py tests/llm/test_async_decode.py tests/encoders/test_qwen2_5_vl.py \
    tests/encoders/test_placement.py} 2>&1 | tee "$OUT/tests.log"
[ "${ENCODER_S:-100}" -gt 0 ] && timeout "${ENCODER_S:-100}" python3 -m bench.gpu_encoder 2>&1 | tee "$OUT/encoder.md"
wait
