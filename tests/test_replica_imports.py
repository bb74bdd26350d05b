"""A replica's start is mostly imports (a new Encoder replica's scale-up waits on them): the modules the ingress, the
LLM and the embedding cache replicas import leave transformers' modeling modules alone, which pull in
torch._dynamo and torch.distributed.tensor (~3 s a process on this VM). Only an Encoder replica imports its family's
tower, when it builds one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("deployments.ingress.server", "llm.server", "encoders.cache_server", "encoders.server", "deployments.app")
HEAVY = ("transformers.modeling_utils", "torch._dynamo", "torch.distributed.tensor")


def _imported_after(modules: tuple[str, ...]) -> list[str]:
    code = "import sys, json\n" + "".join(f"import {m}\n" for m in modules) + "print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=300
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow  # a fresh interpreter imports the servers (~10 s)
def test_the_servers_modules_import_no_transformers_modeling():
    loaded = _imported_after(SERVERS)
    assert "llm.server" in loaded and "encoders.qwen2_vl" in loaded  # the families' preprocessing is imported
    # (transformers.models.auto.modeling_auto is its tokenizers' docstrings' name table, not a model)
    modeling = [m for m in loaded if m.startswith("transformers.models.") and ".modeling_" in m and ".auto." not in m]
    assert modeling == [], f"imported at module import (move into the tower's builder): {modeling}"
    assert [m for m in HEAVY if m in loaded] == []
