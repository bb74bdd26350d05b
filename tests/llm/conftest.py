"""Fixtures of the llm tests: our decoder and vision encoder on the session's tiny checkpoint."""

from __future__ import annotations

import pytest
import torch

from encoders import Qwen2VLVisionEncoder
from llm import Qwen2LM


@pytest.fixture(scope="session")
def model(checkpoint):
    return Qwen2LM.from_pretrained(checkpoint)


@pytest.fixture(scope="session")
def vision(checkpoint):
    return Qwen2VLVisionEncoder(checkpoint)


@pytest.fixture(params=["panels", "onednn"])
def float32_packing(request, monkeypatch):
    """Each way float32 linear weights are packed: our GEMM's panels (where `cpu_kernels.panels_for` takes them: AVX2
    builds), and oneDNN's layout (elsewhere; here with the panels turned off)."""
    from llm.model import cpu_kernels

    assert cpu_kernels.load() is not None, "the CPU kernels must build here (C++ compiler and ninja)"
    if request.param == "panels" and not cpu_kernels.panels_for(torch.empty(16, 8)):
        pytest.skip("our float32 GEMM does not run on this CPU (no AVX2)")
    if request.param == "panels":  # every row count on the panels, AVX-512 CPUs too (their own rule is tested apart)
        monkeypatch.setattr(cpu_kernels.load(), "avx512", False)
    if request.param == "onednn":
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
            pytest.skip("this torch has no oneDNN weight packing")
        monkeypatch.setattr(cpu_kernels, "panels_for", lambda weight: False)
    return request.param
