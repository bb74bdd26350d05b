"""Devices and dtypes per encoder part, and the start-up check that the largest batch fits."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from demo.inputs import make_image
from encoders import EncoderRunner, ModelSpec, Qwen2VLVisionEncoder
from encoders.runner import MEASURE_BATCH, MEASURE_SIZE
from schemas import EncoderArgs


def _runner(checkpoint, **opts) -> EncoderRunner:
    return EncoderRunner(ModelSpec.load(checkpoint, device="cpu", dtype="float32"), EncoderArgs(**opts))


def test_bf16_tower_with_an_fp32_projector(checkpoint):
    image = make_image(96, 72, seed=3)
    full = _runner(checkpoint, startup_check=False).encoder.encode([image])[0]
    mixed = _runner(checkpoint, vision_dtype="bfloat16", projector_dtype="float32", startup_check=False)
    vit = mixed.encoder.vit
    assert next(vit.blocks.parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in vit.merger.parameters())
    assert mixed.parts == {"vision": ("cpu", torch.bfloat16), "projector": ("cpu", torch.float32)}
    out = mixed.encoder.encode([image])[0]
    assert out.dtype == torch.float32 and out.shape == full.shape
    error = ((out - full).norm() / full.norm()).item()
    assert 0 < error < 0.05, error  # a bf16 tower: close to the fp32 answer, not equal to it


SLOW_S = 0.3


def runner_spec(checkpoint) -> ModelSpec:
    return ModelSpec.load(checkpoint, device="cpu", dtype="float32")


def _runner_of(checkpoint, factory) -> EncoderRunner:
    return EncoderRunner(runner_spec(checkpoint), EncoderArgs(), model_factory=factory)


def test_parts_default_to_the_app_device_and_dtype(checkpoint):
    runner = _runner(checkpoint, startup_check=False)
    assert runner.parts == {"vision": ("cpu", torch.float32), "projector": ("cpu", torch.float32)}
    assert not any(type(m).__name__ == "Placed" for m in runner.encoder.vit.modules())


class _Recording(Qwen2VLVisionEncoder):
    batches: list[list[int]] = []  # the patches of each image of each forward

    def forward(self, batch):
        _Recording.batches.append([pixels.shape[0] for pixels, _ in batch])
        return super().forward(batch)


@pytest.mark.parametrize("budget", [1000, 256, 100])
def test_startup_check_encodes_the_worst_batch_and_logs_it(checkpoint, caplog, budget):
    """The batcher's worst forward: as many largest images as encoder.max_batch_patches holds (one alone above it)."""
    _Recording.batches = []
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        spec = ModelSpec.load(checkpoint, device="cpu", dtype="float32")
        runner = EncoderRunner(spec, EncoderArgs(max_batch_patches=budget), model_factory=_Recording)
    side, largest = int(runner.processing.max_pixels**0.5), runner.processing.max_image_tokens * 4  # 2x2 merge
    batch, measured = _Recording.batches
    assert batch == [largest] * max(1, budget // largest)  # 256 patches an image: 3, 1 and 1 of them
    assert f"largest batch ({len(batch)} x {side}x{side}: {sum(batch)} patches of encoder.max_batch_patches " in (
        caplog.text
    )
    # ...then, warm, a batch of typical images: this replica's GFLOP/s, the cost policy's default target
    assert measured == [measured[0]] * min(MEASURE_BATCH, max(1, budget // measured[0]))
    assert runner.gflops > 0 and f"encoder throughput: {runner.gflops:.1f} GFLOP/s on {len(measured)} images" in (
        caplog.text
    )


class _Slow(Qwen2VLVisionEncoder):
    def forward(self, batch):
        time.sleep(SLOW_S)
        return super().forward(batch)


def test_the_measured_rate_is_the_cost_of_the_batch_over_its_time(checkpoint):
    runner = _runner_of(checkpoint, _Slow)
    w, h = MEASURE_SIZE
    work = MEASURE_BATCH * runner_spec(checkpoint).image_cost.gflop(runner.processing.grid_thw(w, h))
    assert work / (SLOW_S + 5.0) < runner.gflops < work / SLOW_S  # the sleep, plus the tiny ViT on a loaded CPU


def test_no_startup_check_measures_nothing(checkpoint):
    assert _runner(checkpoint, startup_check=False).gflops is None


class _TooBig(Qwen2VLVisionEncoder):
    def forward(self, batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def test_an_encoder_that_cannot_fit_its_largest_batch_refuses_to_start(checkpoint):
    with pytest.raises(RuntimeError, match=r"largest batch .* out of memory .* Lower encoder.max_batch_patches"):
        EncoderRunner(ModelSpec.load(checkpoint, device="cpu", dtype="float32"), EncoderArgs(), model_factory=_TooBig)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tower_on_gpu_projector_on_cpu(checkpoint):
    # The reference is the whole encoder on the GPU, not the CPU: the random checkpoint's attention is near one-hot,
    # and the GPU's own float32 numerics (cuDNN's TF32 convolution, its SDPA kernels) move it (seen on an H100).
    image = make_image(96, 72, seed=3)
    full = _runner(checkpoint, vision_device="cuda", vision_dtype="float32", startup_check=False)
    full = full.encoder.encode([image])[0].cpu()
    split = _runner(
        checkpoint, vision_device="cuda", vision_dtype="float32", projector_device="cpu", startup_check=False
    )
    out = split.encoder.encode([image])[0]
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, full, atol=1e-4, rtol=1e-4)
