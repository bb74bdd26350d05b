"""Image bytes in, embeddings out: decode and preprocess on a worker thread, then a ViT forward of the images of
concurrent callers packed together (`ImageBatcher`: a patch budget and a maximum wait).

Used by the Encoder deployment, and by the LLM replica itself in colocated mode (`encoder.colocated`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from encoders.family import VisionEncoder
from encoders.images import image_size, load_rgb
from encoders.model_spec import ModelSpec
from encoders.placement import check_worst_case, place_projector
from encoders.startup_checks import CheckResult, StartupChecks, check_key, checkpoint_identity, device_identity
from encoders.video_decode import Video
from schemas import EncoderArgs, VideoArgs, resolve_device, resolve_dtype

logger = logging.getLogger("ray.serve")
MEASURE_SIZE, MEASURE_BATCH = (448, 448), 4  # the start-up throughput measurement: a batch of typical chat images


Preprocessed = tuple[torch.Tensor, tuple[int, int, int]]  # (pixel_values (patches, dim), grid (t, h, w))


@dataclass(slots=True)
class _Waiting:
    image: Preprocessed
    future: asyncio.Future

    @property
    def patches(self) -> int:
        return self.image[0].shape[0]


class ImageBatcher:
    """`await encode(image)` from many tasks; a batch closes when it reaches `max_patches` or, while the
    encoder is idle, after `max_wait_s`. The forward runs on a worker thread, off the event loop. An image larger
    than the budget runs alone. (Like Ray Serve's `@serve.batch`, but bounded by patches, not by count.)"""

    def __init__(
        self,
        forward: Callable[[list[Preprocessed]], list[torch.Tensor]],
        *,
        max_patches: int,
        max_wait_s: float,
        on_batch: Callable[[int, float], None] | None = None,
    ):
        self.forward, self.max_patches, self.max_wait_s = forward, max_patches, max_wait_s
        self.on_batch = on_batch  # (images, seconds) of each forward that ran, for metrics
        self._queue: asyncio.Queue[_Waiting] | None = None
        self._task: asyncio.Task | None = None
        self.num_batches = self.num_images = 0

    async def encode(self, image: Preprocessed) -> torch.Tensor:
        if self._task is None:  # created on the loop that uses it
            self._queue = asyncio.Queue()
            self._task = asyncio.create_task(self._loop())
        assert self._queue is not None
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Waiting(image, future))
        return await future

    async def _collect(self, first: _Waiting) -> tuple[list[_Waiting], _Waiting | None]:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        batch, patches, deadline = [first], first.patches, loop.time() + self.max_wait_s
        while patches < self.max_patches:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                try:
                    async with asyncio.timeout_at(deadline):  # NOTE: not wait_for: see tests/test_house.py
                        item = await self._queue.get()
                except TimeoutError:
                    break
            if patches + item.patches > self.max_patches:
                return batch, item  # it opens the next batch
            batch.append(item)
            patches += item.patches
        return batch, None

    async def _loop(self) -> None:
        assert self._queue is not None
        carry: _Waiting | None = None
        while True:
            batch, carry = await self._collect(carry or await self._queue.get())
            live = [item for item in batch if not item.future.done()]  # callers that gave up are skipped
            if not live:
                continue
            started = time.monotonic()
            try:
                outputs = await asyncio.to_thread(self.forward, [item.image for item in live])
            except Exception as e:  # every caller of this batch gets the error; the loop goes on
                for item in live:
                    if not item.future.done():
                        item.future.set_exception(e)
                continue
            self.num_batches += 1
            self.num_images += len(live)
            if self.on_batch is not None:
                self.on_batch(len(live), time.monotonic() - started)
            for item, out in zip(live, outputs, strict=True):
                if not item.future.done():
                    item.future.set_result(out)


def _part(device: str | None, dtype: str | None, default: tuple[str, torch.dtype]) -> tuple[str, torch.dtype]:
    """A part's (device, dtype): its own settings, else the default; `auto` dtypes follow the part's device."""
    dev = resolve_device(device, torch.cuda.is_available()) if device is not None else default[0]
    if dtype is None:
        return dev, default[1] if device is None else getattr(torch, resolve_dtype("auto", dev))
    return dev, getattr(torch, resolve_dtype(dtype, dev))


class EncoderRunner:
    def __init__(
        self,
        spec: ModelSpec,
        opts: EncoderArgs,
        *,
        model_factory: Callable[..., VisionEncoder] | None = None,
        on_batch: Callable[[int, float], None] | None = None,
        video: VideoArgs | None = None,
        on_video: Callable[[float], None] | None = None,
        checks: StartupChecks | None = None,
        on_phase: Callable[[str], None] | None = None,
    ):
        """`model_factory(model_dir, device=, dtype=, config=)` stands in for the family's encoder (tests); `video`: the
        limits of video decoding (the defaults when None); `on_video(seconds)`: after each video's decoding;
        `checks`: where the start-up check's results are kept and reused (None: check every time); `on_phase(name)`:
        when the tower is built ("model") and when the start-up check is done ("check")."""
        model_dir, family = spec.model_dir, spec.family
        self.processing, self.video_processing = spec.processing, spec.video_processing
        self.video, self.on_video = video or VideoArgs(), on_video
        vision = _part(opts.vision_device, opts.vision_dtype, (spec.device, spec.dtype))
        projector = _part(opts.projector_device, opts.projector_dtype, vision)
        # NOTE: given the spec's config, neither builder reads config.json again (an Encoder replica's, sent as data,
        # keeps transformers out of its start: encoders/checkpoint_config.py)
        build = model_factory if model_factory is not None else family.encoder
        self.encoder = build(model_dir, device=vision[0], dtype=vision[1], config=spec.hf_config)
        if projector != vision:
            if family.projector is None:
                raise ValueError(f"{Path(model_dir).name}: this family's projector cannot be placed on its own")
            place_projector(self.encoder, family.projector, torch.device(projector[0]), projector[1])
        self.parts = {"vision": vision, "projector": projector}
        if on_phase is not None:
            on_phase("model")
        self.gflops: float | None = None  # measured at start, after the start-up check's warm forward
        self.startup_check = "off"  # "ran", or "reused" (this node's result for the same key)
        if opts.startup_check:
            key = check_key(
                checkpoint=checkpoint_identity(model_dir),
                processing=self.processing.fingerprint(),
                parts=self.parts,
                devices=sorted({device_identity(vision[0]), device_identity(projector[0])}),
                max_batch_patches=opts.max_batch_patches,
                threads=torch.get_num_threads(),
                torch=torch.__version__,
                factory=model_factory,
            )
            if checks is not None and (kept := checks.get(key)) is not None:
                self._warm()
                logger.info(
                    "encoder start-up check: this node's result of %.0f s ago reused: largest batch (%s) encoded in "
                    "%.2f s, %s; %.1f GFLOP/s",
                    time.time() - kept.checked_at, kept.what, kept.seconds, kept.peak, kept.gflops,
                )  # fmt: skip
                self.gflops, self.startup_check = kept.gflops, "reused"
            else:
                result = self._check(spec, opts, torch.device(vision[0]))
                self.gflops, self.startup_check = result.gflops, "ran"
                if checks is not None:
                    checks.put(key, result)
        if on_phase is not None:
            on_phase("check")
        self.jpeg_draft = opts.jpeg_draft
        self.batcher = ImageBatcher(
            self.encoder.forward,
            max_patches=opts.max_batch_patches,
            max_wait_s=opts.max_batch_wait_ms / 1000,
            on_batch=on_batch,
        )

    def _check(self, spec: ModelSpec, opts: EncoderArgs, device: torch.device) -> CheckResult:
        """The batcher's worst forward (as many largest images as max_batch_patches holds; refuses to start if it does
        not fit), then the throughput measured warm."""
        w, h = self.processing.worst_case_size()
        image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8))
        largest = self.encoder.preprocess(image)
        count = max(1, opts.max_batch_patches // largest[0].shape[0])  # one alone when it is over the budget
        what = (
            f"{count} x {w}x{h}: {count * largest[0].shape[0]} patches of encoder.max_batch_patches "
            f"{opts.max_batch_patches}, {self.processing.max_image_tokens} tokens an image"
        )
        seconds, peak = check_worst_case(lambda: self.encoder.forward([largest] * count), device, what)
        return CheckResult(what, seconds, peak, self._measure_gflops(spec, opts.max_batch_patches), time.time())

    def _warm(self) -> None:
        """One small image through the tower: what a process's first forward costs (kernels, allocations) is not
        the first client's."""
        [t.cpu() for t in self.encoder.forward([self.encoder.preprocess(Image.new("RGB", (64, 64)))])]

    def _measure_gflops(self, spec: ModelSpec, max_batch_patches: int) -> float:
        """GFLOP/s (encoders/cost.py's estimate) of one forward of a batch of typical chat images, timed warm."""
        w, h = MEASURE_SIZE
        image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (h, w, 3), dtype=np.uint8))
        one = self.encoder.preprocess(image)
        count = max(1, min(MEASURE_BATCH, max_batch_patches // one[0].shape[0]))
        start = time.perf_counter()
        [t.cpu() for t in self.encoder.forward([one] * count)]  # .cpu(): waits for the device
        gflops = count * spec.image_cost.gflop(self.processing.grid_thw(w, h)) / (time.perf_counter() - start)
        logger.info("encoder throughput: %.1f GFLOP/s on %d images of %dx%d", gflops, count, w, h)
        return gflops

    def _preprocess(self, data: bytes) -> Preprocessed:
        if self.jpeg_draft:  # decode at a reduced scale where the target size allows (JPEG only)
            size = image_size(data)
            return self.encoder.preprocess(load_rgb(data, draft_size=self.processing.resized_size(*size)), size)
        return self.encoder.preprocess(load_rgb(data))

    def _preprocess_video(self, video: Video) -> Preprocessed:
        assert self.video_processing is not None, "the ingress sends videos only to families that take them"
        started = time.monotonic()
        frames = video.decode(self.video.decode_timeout_s, self.video.decode_memory_mib)  # (n, h, w, 3) uint8
        if self.on_video is not None:
            self.on_video(time.monotonic() - started)
        pixel_values, grid = self.video_processing.preprocess(frames)
        assert grid == video.plan.grid_thw, (grid, video.plan.grid_thw)  # the ingress counted its tokens with it
        return pixel_values, grid

    async def encode(self, data: bytes | Video) -> torch.Tensor:
        """An image's bytes, or a video (decoded in a process of its own), -> its embedding rows."""
        work = self._preprocess_video if isinstance(data, Video) else self._preprocess
        preprocessed = await asyncio.to_thread(work, data)  # off the event loop
        return (await self.batcher.encode(preprocessed)).cpu()

    def stats(self) -> dict[str, int]:
        return {"batches": self.batcher.num_batches, "images": self.batcher.num_images}


__all__ = ["EncoderRunner", "ImageBatcher", "Preprocessed"]
