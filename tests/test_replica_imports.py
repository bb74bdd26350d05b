"""A replica's start is mostly imports (a new Encoder replica's scale-up waits on them): the modules the ingress and
the LLM replicas import leave transformers' modeling modules alone, which pull in
torch._dynamo and torch.distributed.tensor (~3 s a process on this VM). Only an Encoder replica imports its family's
tower, when it builds one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("deployments.ingress.server", "deployments.llm.server", "deployments.encoder.server", "deployments.app")
HEAVY = ("transformers.modeling_utils", "torch._dynamo", "torch.distributed.tensor")


def _imported_after(modules: tuple[str, ...], then: str) -> tuple[list[str], list[str]]:
    """The modules a fresh interpreter has after importing `modules`, and after running `then` as well."""
    dump = "print(json.dumps(sorted(sys.modules)))\n"
    code = "import sys, json\n" + "".join(f"import {m}\n" for m in modules) + dump + then + "\n" + dump
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=300
    )
    *_, imported, ran = out.stdout.splitlines()
    return json.loads(imported), json.loads(ran)


@pytest.fixture(scope="module")
def imported(checkpoint) -> tuple[list[str], list[str]]:
    """After the servers' imports, then after an LLM replica's model load (`Qwen2LM.from_pretrained`)."""
    load = f"from llm.model.model import Qwen2LM; Qwen2LM.from_pretrained({str(checkpoint)!r})"
    return _imported_after(SERVERS, load)


@pytest.mark.slow  # a fresh interpreter imports the servers (~10 s)
def test_the_servers_modules_import_no_transformers_modeling(imported):
    loaded, _ = imported
    assert "deployments.llm.server" in loaded and "encoders.qwen2_vl" in loaded  # the families' preprocessing too
    # (transformers.models.auto.modeling_auto is its tokenizers' docstrings' name table, not a model)
    modeling = [m for m in loaded if m.startswith("transformers.models.") and ".modeling_" in m and ".auto." not in m]
    assert modeling == [], f"imported at module import (move into the tower's builder): {modeling}"
    assert [m for m in HEAVY if m in loaded] == []


@pytest.mark.slow
def test_loading_the_language_model_imports_no_dynamo(imported):
    """The model is built on meta, then given the checkpoint's tensors: no init of the meta tensors may run
    torch._refs, which imports torch._dynamo (2.7 CPU-s of each LLM replica's start)."""
    _, loaded = imported
    assert [m for m in HEAVY if m in loaded] == []
