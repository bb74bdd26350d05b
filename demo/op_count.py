"""Counting the ops a piece of torch code dispatches (the decode step's ops per layer: tests and `make bench-kernels`).

Not counted: views move no data, and an allocation is part of the op that fills it (an aten op allocates its output
inside, unseen; the CPU kernels' allocations would be seen). The CPU kernels' own calls are not dispatched, so
callers add `llm.model.cpu_kernels.calls`. No project imports: bench/step_child.py loads it by path
beside a baseline tree.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ALLOCATIONS = (torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided)


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not func.is_view and func.overloadpacket not in _ALLOCATIONS
        return func(*args, **(kwargs or {}))
