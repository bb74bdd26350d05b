"""The training script runs end to end and writes a checkpoint our server loads (a smoke test: two steps)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from demo.inputs import make_image
from deployments.ingress.prompt import load_tokenizer
from encoders import EncoderRunner, ModelSpec, family_of
from llm import Qwen2LM
from schemas import EncoderArgs


@pytest.mark.slow
def test_two_steps_write_a_checkpoint_the_server_loads(tmp_path):
    out = tmp_path / "shapes"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "demo.train",
            "--out",
            str(out),
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--eval-every",
            "1000",
            "--threads",
            "1",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert family_of(out).processing.from_pretrained(out).max_image_tokens == 36
    tokenizer = load_tokenizer(out)
    assert len(tokenizer.encode("What colour is the star?", add_special_tokens=False)) <= 8  # scene words are tokens
    model = Qwen2LM.from_pretrained(out)
    runner = EncoderRunner(ModelSpec.load(out, device="cpu", dtype="float32"), EncoderArgs(startup_check=False))
    embeds = runner.encoder.encode([make_image(200, 120)])[0]
    assert embeds.shape[1] == model.config.hidden_size
