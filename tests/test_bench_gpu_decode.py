"""bench/gpu_decode.py, the script a GPU run executes unchanged (bench/gpu.sh): on CPU with the tiny shape, every part
and every decode mode that CPU can run (graphs and compiling are cuda's) still runs and reports."""

from __future__ import annotations

import pytest

from bench import gpu_decode
from llm.model import pdl, triton_attention, triton_fused, triton_gemm

# what the modes switch (gpu_decode._use_kernels): put back after the test, for the tests after it in this process
FLAGS = [(triton_fused, "enabled"), (triton_gemm, "enabled"), (triton_gemm, "fuse_norm"), (triton_gemm, "fuse_silu"),
         (triton_gemm, "fuse_rope"), (triton_attention, "fold_combine"), (pdl, "enabled"),
         (pdl, "prefetch")]  # fmt: skip


@pytest.mark.slow  # 7-10 s
def test_each_part_and_mode_runs_on_cpu(capsys, monkeypatch):
    for module, name in FLAGS:
        monkeypatch.setattr(module, name, getattr(module, name))
    modes = [m for m in gpu_decode.MODES if m not in ("graphs", "compiled")]
    argv = ["--device", "cpu", "--shape", "tiny", "--batches", "1,2", "--output-len", "3", "--profile-batch", "1"]
    assert gpu_decode.main([*argv, "--modes", ",".join(modes)]) == 0
    out = capsys.readouterr().out
    for part in ("decode", "check", "launches"):
        assert f"[{part}: " in out and f"[{part}: FAILED]" not in out, out[-3000:]
    for mode in modes:
        assert f"| 1 | {mode} |" in out and f"| 2 | {mode} |" in out, mode
        assert f"| {mode} | " in out  # its launches row
    assert out.count("greedy tokens == cpu float32 eager: True") == 2
