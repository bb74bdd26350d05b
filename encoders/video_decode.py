"""A video's sampled frames, decoded in a process of their own (encoders/video_worker.py) under a memory limit and a
wall-clock limit, or a frame list's images decoded here; either way resized to the plan's size. `run_worker` starts
that process, for the ingress's container probe too."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from encoders.images import load_rgb
from encoders.video_processing import VideoPlan
from schemas import InvalidRequest

WORKER = Path(__file__).with_name("video_worker.py")


@dataclass(frozen=True, slots=True)
class Video:
    """What the ingress sends an encoder for one video: its bytes (a container, or a frame list's images) and the
    sampling the ingress planned (and counted its tokens with)."""

    data: bytes | list[bytes]
    plan: VideoPlan

    def decode(self, timeout_s: float, memory_mib: int) -> np.ndarray:
        if isinstance(self.data, list):
            return decode_frames(self.data, self.plan)
        return decode_video(self.data, self.plan, timeout_s, memory_mib)


def decode_video(data: bytes, plan: VideoPlan, timeout_s: float, memory_mib: int) -> np.ndarray:
    """The plan's frames of a container, (n, height, width, 3) uint8. Any failure of the decoding process (an
    error, a crash, a limit) is the client's 400: the video, not this replica, is bad."""
    header = {"indices": list(plan.indices), "width": plan.width, "height": plan.height, "memory_mib": memory_mib}
    out = run_worker(header, data, timeout_s, "decoding", "video could not be decoded")
    expected = len(plan.indices) * plan.height * plan.width * 3
    if len(out) != expected:
        raise InvalidRequest(f"video could not be decoded: {len(out)} bytes of frames, {expected} expected")
    return np.frombuffer(out, dtype=np.uint8).reshape(len(plan.indices), plan.height, plan.width, 3)


def run_worker(header: dict, data: bytes, timeout_s: float, what: str, failed: str) -> bytes:
    """The video process's stdout for `header` and the container's bytes (encoders/video_worker.py). Its failure
    (an error, a crash, a limit) is the client's 400, saying that `what` ("decoding") took too long, or `failed`
    and why: the caller's process and its memory are never touched."""
    # NOTE: -I: the worker sees neither PYTHONPATH nor this project; it imports only av and PIL.
    with subprocess.Popen(
        [sys.executable, "-I", str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        try:
            out, err = proc.communicate(json.dumps(header).encode() + b"\n" + data, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise InvalidRequest(f"video {what} took over the limit of {timeout_s:g} s") from None
    if (rc := proc.returncode) != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        if rc == 2 and lines:
            why = lines[-1][:200]
        elif rc < 0:  # a crash in FFmpeg (SIGSEGV...), or the kernel's OOM killer
            why = f"the {what} process was killed by {signal.Signals(-rc).name}"
        else:
            why = f"the {what} process ended with code {rc}"
        raise InvalidRequest(f"{failed}: {why}")
    return out


def decode_frames(frames: list[bytes], plan: VideoPlan) -> np.ndarray:
    """A frame list's images (checked by their headers at the ingress), in the plan's order and size."""
    out = np.empty((len(plan.indices), plan.height, plan.width, 3), dtype=np.uint8)
    for k, i in enumerate(plan.indices):
        image = load_rgb(frames[i])
        if image.size != (plan.width, plan.height):
            image = image.resize((plan.width, plan.height), resample=Image.Resampling.BICUBIC)
        out[k] = np.asarray(image)
    return out


__all__ = ["WORKER", "Video", "decode_frames", "decode_video", "run_worker"]
