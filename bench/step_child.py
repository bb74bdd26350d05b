"""Child of `bench/step_ab.py`: times one decode step (forward + logits + argmax) of the bench checkpoint with
the `llm` package of the tree given as argv[1] (the current one or a baseline commit's), on a worker thread with
the threads the engine gives it, and counts the ops it dispatches per layer (views excluded: they move no data).
Prints one JSON line: {"<dtype> b<batch>": [ms, ops per layer], ...}. Uses only the API both trees share.
VLM_HELPER_THREAD=0: decode attention and GEMMs on the worker's thread alone (llm.cpu_helper_thread: false);
VLM_HELPER_LINEARS=0: the helper shares the attention only (weights packed whole)."""

import json
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, sys.argv[1])
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo"))

import torch  # noqa: E402
from op_count import OpCount  # noqa: E402  (this tree's demo/op_count.py, whichever tree's llm is timed)

try:  # the tree as it is now: llm/model/, llm/engine/
    from llm.engine.threads import set_thread_intra_op_threads
    from llm.model import BatchMeta, ChunkSpec, Qwen2LM
    from llm.model import cpu_kernels as kernels
except ImportError:  # a baseline from before the split (flat llm/)
    from llm.threads import set_thread_intra_op_threads

    from llm import BatchMeta, ChunkSpec, Qwen2LM

    try:
        from llm import cpu_kernels as kernels
    except ImportError:  # older still: no CPU kernels
        kernels = None

try:  # trees whose model runner packs float32 linear weights for oneDNN
    from llm.model.layers import pack_linears
except ImportError:
    pack_linears = None

BS, NUM_BLOCKS = 16, 3000


def _batch(n: int) -> list:
    """n decode rows with contexts of 90..450 tokens (seeded), blocks scattered through the pool."""
    rng = random.Random(0)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    return [
        ChunkSpec([free.pop() for _ in range(s // BS + 1)], s, 1)
        for s in sorted(rng.randint(90, 450) for _ in range(n))
    ]


def main() -> None:
    checkpoint, threads, reps = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cases = [(dtype, int(b)) for dtype in sys.argv[5].split(",") for b in sys.argv[6].split(",")]
    torch.set_num_threads(1)  # as the LLM replica: one thread process-wide, the worker's own team
    if kernels is not None:  # trees with CPU kernels: their model runner builds them at start, so do the same here
        kernels.load()
        helper = os.environ.get("VLM_HELPER_THREAD", "1") == "1"
        if hasattr(kernels, "use_helper"):  # trees whose helper shares the GEMMs too: as the model runner sets it
            kernels.use_helper(helper)
        elif hasattr(kernels, "share_decode"):  # trees with the attention helper alone
            kernels.share_decode(helper)
    result: dict[str, list[float]] = {}

    def worker() -> None:
        set_thread_intra_op_threads(threads)
        for dtype in dict.fromkeys(d for d, _ in cases):
            model = Qwen2LM.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
            if pack_linears is not None:  # trees whose model runner packs float32 weights at start: the same here
                if hasattr(kernels, "pack_chunks"):  # as the model runner of a one-thread decode worker packs them
                    shared = kernels.helper_on() and os.environ.get("VLM_HELPER_LINEARS", "1") == "1"
                    pack_linears(model, kernels.SHARE_CHUNKS if shared else 1)
                else:
                    pack_linears(model)
            cache = model.new_cache(NUM_BLOCKS, BS)
            for b in (b for d, b in cases if d == dtype):
                chunks = _batch(b)
                x = torch.randn(b, model.config.hidden_size, dtype=model.lm_head.weight.dtype)
                pos = torch.tensor([c.start for c in chunks]).expand(3, -1)

                def step():
                    with torch.inference_mode():
                        hidden = model(x, pos, cache, BatchMeta.build(chunks, BS, torch.device("cpu")))
                        return model.logits(hidden).argmax(-1).tolist()

                step()
                kernel_calls = getattr(kernels, "calls", 0)
                with OpCount() as ops:
                    step()
                ops.n += getattr(kernels, "calls", 0) - kernel_calls  # the CPU kernels' calls: ops the mode misses
                times = []
                for _ in range(reps):
                    t = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - t)
                result[f"{dtype} b{b}"] = [statistics.median(times) * 1e3, ops.n / model.config.num_layers]

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
