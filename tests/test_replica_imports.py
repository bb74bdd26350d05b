"""A replica's start is mostly imports (a new Encoder replica's scale-up waits on them): the modules the ingress and
the LLM replicas import leave transformers' modeling modules alone, which pull in
torch._dynamo and torch.distributed.tensor (~3 s a process on this VM). The vision towers are ours too (Qwen2-VL's and
Qwen2.5-VL's: encoders/qwen_vit.py; LLaVA's and LLaVA-NeXT's CLIP and projector: encoders/clip_vit.py): an Encoder
replica builds one without them, and, sent the checkpoint's config as data by the app builder, imports no transformers
at all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("deployments.ingress.server", "deployments.llm.server", "deployments.encoder.server", "deployments.app")
HEAVY = ("transformers.modeling_utils", "torch._dynamo", "torch.distributed.tensor")


def _imported_after(modules: tuple[str, ...], *then: str) -> tuple[list[str], ...]:
    """The modules a fresh interpreter has after importing `modules`, then after running each of `then` as well."""
    dump = "print(json.dumps(sorted(sys.modules)))\n"
    code = (
        "import sys, json\n" + "".join(f"import {m}\n" for m in modules) + dump + "".join(t + "\n" + dump for t in then)
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=300
    )
    return tuple(json.loads(line) for line in out.stdout.splitlines()[-1 - len(then) :])


def _modeling(loaded: list[str]) -> list[str]:
    """transformers' model modules among `loaded` (transformers.models.auto.modeling_auto is its tokenizers'
    docstrings' name table, not a model)."""
    return [m for m in loaded if m.startswith("transformers.models.") and ".modeling_" in m and ".auto." not in m]


@pytest.fixture(scope="module")
def imported(checkpoint) -> tuple[list[str], list[str]]:
    """After the servers' imports, then after an LLM replica's model load (`Qwen2LM.from_pretrained`)."""
    load = f"from llm.model.model import Qwen2LM; Qwen2LM.from_pretrained({str(checkpoint)!r})"
    return _imported_after(SERVERS, load)


@pytest.mark.slow  # a fresh interpreter imports the servers (~10 s)
def test_the_servers_modules_import_no_transformers_modeling(imported):
    loaded, _ = imported
    assert "deployments.llm.server" in loaded and "encoders.qwen2_vl" in loaded  # the families' preprocessing too
    modeling = _modeling(loaded)
    assert modeling == [], f"imported at module import (move into the tower's builder): {modeling}"
    assert [m for m in HEAVY if m in loaded] == []


@pytest.mark.slow
def test_loading_the_language_model_imports_no_dynamo(imported):
    """The model is built on meta, then given the checkpoint's tensors: no init of the meta tensors may run
    torch._refs, which imports torch._dynamo (2.7 CPU-s of each LLM replica's start)."""
    _, loaded = imported
    assert [m for m in HEAVY if m in loaded] == []


def _builds(encoders: dict[str, Path]) -> str:
    """Code that builds each encoder class of `encoders` from its checkpoint and encodes an image, as an Encoder
    replica's start does (its start-up check)."""
    return f"from PIL import Image\nfrom encoders import {', '.join(sorted(encoders))}\n" + "".join(
        f"assert len({cls}({str(ckpt)!r}).encode([Image.new('RGB', (64, 64))])) == 1\n"
        for cls, ckpt in encoders.items()
    )


@pytest.mark.slow
def test_building_the_qwen_encoders_imports_no_transformers_modeling(checkpoint, tmp_path):
    """An Encoder replica's start for Qwen2-VL and Qwen2.5-VL. Their towers are ours (encoders/qwen_vit.py): none of
    transformers' modeling, nor what it pulls in (1.4-2 CPU-s of each replica's start)."""
    from demo.tiny_qwen2_5_vl import build_qwen2_5_vl_checkpoint

    qwen2_5 = build_qwen2_5_vl_checkpoint(tmp_path / "qwen2.5-vl-tiny", seed=1)
    build = _builds({"Qwen2VLVisionEncoder": checkpoint, "Qwen2_5_VLVisionEncoder": qwen2_5})
    _, loaded = _imported_after(("encoders",), build)
    assert "encoders.qwen_vit" in loaded
    modeling = _modeling(loaded)
    assert modeling == [], f"the Qwen towers are ours: no transformers modeling to build one, got {modeling}"
    assert [m for m in HEAVY if m in loaded] == []


# A tower of LLaVA's shape from plain attributes (no transformers config: see below), built as the encoder builds
# it (on meta, then given memory) and run.
_CLIP_TOWER = """
import types, torch
from encoders.clip_vit import ClipVisionTower, LlavaProjector
vc = types.SimpleNamespace(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_channels=3, image_size=56, patch_size=14, hidden_act="quick_gelu", layer_norm_eps=1e-5)
config = types.SimpleNamespace(vision_config=vc, text_config=types.SimpleNamespace(hidden_size=64),
    vision_feature_layer=[-3, -1], projector_hidden_act="gelu", multimodal_projector_bias=True)
with torch.device("meta"):
    tower, projector = ClipVisionTower(vc), LlavaProjector(config)
tower, projector = tower.to_empty(device="cpu"), projector.to_empty(device="cpu")
with torch.inference_mode():
    assert projector(torch.cat(tower(torch.zeros(2, 3, 56, 56), [0, 2]), -1)).shape == (2, 17, 64)
"""


@pytest.mark.slow
def test_building_the_llava_encoders_imports_no_transformers_modeling(tmp_path):
    """An Encoder replica's start for LLaVA-1.5 and LLaVA-NeXT. Their CLIP tower and projector are ours
    (encoders/clip_vit.py): none of transformers' modeling (transformers.modeling_utils and the CLIP and LLaVA
    modules), and the tower alone pulls in none of torch._dynamo and torch.distributed.tensor either.

    NOTE: LLaVA's transformers config does pull those two in (transformers 5.23: its text config, LlamaConfig,
    imports transformers.utils.type_validators, which imports transformers.activations, whose hub-kernels imports
    reach DTensor and torch.compiler.disable; ~1.2 CPU-s): a process that reads it through transformers has them
    (here, and the ingress and LLM replicas); an Encoder replica is sent it as data (the next test)."""
    from demo.tiny_llava import build_llava_checkpoint
    from demo.tiny_llava_next import build_llava_next_checkpoint

    build = _builds(
        {
            "LlavaVisionEncoder": build_llava_checkpoint(tmp_path / "llava-tiny"),
            "LlavaNextVisionEncoder": build_llava_next_checkpoint(tmp_path / "llava-next-tiny"),
        }
    )
    _, tower, loaded = _imported_after(("encoders",), _CLIP_TOWER, build)
    assert [m for m in HEAVY if m in tower] == [] and _modeling(tower) == []
    assert "encoders.clip_vit" in loaded
    modeling = _modeling(loaded)
    assert modeling == [], f"the LLaVA tower and projector are ours: no transformers modeling, got {modeling}"
    assert "transformers.modeling_utils" not in loaded


def _builds_from_sent_configs(checkpoints: list[Path]) -> str:
    """Code that builds, as an Encoder replica does (deployments/encoder/server.py), each checkpoint's encoder from the
    config the app builder sends (`plain_config`, as data) and encodes an image."""
    from encoders.checkpoint_config import plain_config, read_config

    sent = {str(c): plain_config(read_config(c)) for c in checkpoints}
    return (
        "from PIL import Image\nfrom encoders import EncoderRunner, ModelSpec\n"
        "from encoders.checkpoint_config import ConfigView\nfrom schemas import AppArgs\n"
        f"for model, config in json.loads({json.dumps(sent)!r}).items():\n"
        "    args = AppArgs(model=model, device='cpu', encoder={'startup_check': False})\n"
        "    runner = EncoderRunner(ModelSpec.from_args(args, ConfigView(config)), args.encoder)\n"
        "    assert len(runner.encoder.encode([Image.new('RGB', (64, 64))])) == 1\n"
    )


@pytest.mark.slow
def test_an_encoder_replica_given_the_app_builders_config_imports_no_transformers(checkpoint, tmp_path):
    """The app builder sends the Encoder the config it read (deployments/app.py): a new replica's start then imports
    no transformers at all, for every family (~0.9 CPU-s of a Qwen replica's start, ~1.8 of a LLaVA one's, whose
    config alone pulls in torch._dynamo)."""
    from demo.tiny_llava import build_llava_checkpoint
    from demo.tiny_llava_next import build_llava_next_checkpoint
    from demo.tiny_qwen2_5_vl import build_qwen2_5_vl_checkpoint

    checkpoints = [
        checkpoint,
        build_qwen2_5_vl_checkpoint(tmp_path / "qwen2.5-vl-tiny", seed=1),
        build_llava_checkpoint(tmp_path / "llava-tiny"),
        build_llava_next_checkpoint(tmp_path / "llava-next-tiny"),
    ]
    imported, built = _imported_after(("deployments.encoder.server",), _builds_from_sent_configs(checkpoints))
    assert "encoders.clip_vit" in built and "encoders.qwen_vit" in built
    for loaded in (imported, built):
        assert [m for m in loaded if m.split(".")[0] == "transformers"] == []
        assert [m for m in HEAVY if m in loaded] == []
