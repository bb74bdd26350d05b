"""Tensor-parallel ranks 1..N-1 of an LLM replica: Ray actors in the replica's placement group (rank 0 is the
replica itself), and the placement and GPU checks that `build_app` does before anything starts."""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

import ray
import torch
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from llm import Qwen2LM
from llm.engine.threads import set_thread_intra_op_threads
from llm.model.parallel import TPGroup, init_process_group, serve_rank

logger = logging.getLogger("ray.serve")
# NOTE: how long a collective waits for a rank that neither answers nor dies (a dead process closes its sockets,
# which fails the collective at once). Ranks run the same step in lockstep, so this only bounds a hung rank.
COLLECTIVE_TIMEOUT_S = 120.0


@ray.remote(max_concurrency=2)  # NOTE: `ready` answers while `serve` runs its loop
class Rank:
    def __init__(self, rank: int, world_size: int):
        self.group = TPGroup(rank, world_size)
        self.model: Qwen2LM | None = None

    def ready(self) -> None:
        """Answers once the actor is placed and constructed."""

    def setup(self, model_dir: str, device: str, dtype: str, init_method: str, cpu_threads: int) -> None:
        """Join the process group and load this rank's shard (rank 0 does the same meanwhile)."""
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                f"tensor-parallel rank {self.group.rank} has no GPU: give every entry of the LLM's "
                "placement_group_bundles GPU: 1"
            )
        torch.set_num_threads(1)  # NOTE: the loop's thread gets the cores (llm/engine/threads.py)
        self.cpu_threads = cpu_threads if device == "cpu" else None
        dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
        init_process_group(self.group.rank, self.group.world_size, init_method, dev, COLLECTIVE_TIMEOUT_S)
        self.model = Qwen2LM.from_pretrained(model_dir, device=str(dev), dtype=getattr(torch, dtype), tp=self.group)

    def serve(self) -> None:
        """Follow rank 0 until it stops; returns (or raises) only when this rank is done for."""
        error: list[BaseException] = []

        def loop() -> None:  # a thread of our own, so that only it gets the OpenMP team (llm/engine/threads.py)
            try:
                if self.cpu_threads is not None:
                    set_thread_intra_op_threads(self.cpu_threads)
                serve_rank(self.model)
            except BaseException as e:
                error.append(e)

        thread = threading.Thread(target=loop, name=f"tp-rank-{self.group.rank}", daemon=True)
        thread.start()
        thread.join()
        if error:
            raise error[0]


class Ranks:
    """Rank 0's handle on the others: started with the replica, watched by its health check."""

    def __init__(self, world_size: int, device: str):
        pg = get_current_placement_group()
        if pg is not None and len(pg.bundle_specs) < world_size:
            raise ValueError(
                f"tensor_parallel_size={world_size} needs {world_size} placement_group_bundles (one per "
                f"rank, rank 0 in the first), but the LLM deployment has {len(pg.bundle_specs)}"
            )
        if pg is None:
            logger.warning(
                "LLM replica has no placement group: its %d tensor-parallel ranks may land on other "
                "nodes (build_app sets placement_group_bundles; was it overridden?)",
                world_size,
            )
        self.actors, self.cpus = [], []  # ranks 1..N-1, and the CPUs each reserved
        for rank in range(1, world_size):
            if pg is not None:
                spec = pg.bundle_specs[rank]
                options: dict[str, Any] = {
                    "num_cpus": spec.get("CPU", 0),
                    "num_gpus": spec.get("GPU", 0),
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
                }
            else:
                options = {"num_cpus": 1, "num_gpus": 1 if device == "cuda" else 0}
            self.actors.append(Rank.options(**options).remote(rank, world_size))
            self.cpus.append(max(1, int(options["num_cpus"])))
        self.loops: list[ray.ObjectRef] = []

    def start(self, model_dir: str, device: str, dtype: str, cpu_threads: int | None, join_rank0) -> None:
        """All ranks join and load their shards; then the others enter their loops. `join_rank0(init_method)`
        joins this process as rank 0 and loads its shard. On cpu each rank's loop gets `cpu_threads` threads, by
        default the CPUs of its bundle."""
        ray.get([a.ready.remote() for a in self.actors])  # placed and alive before anyone waits on a rendezvous
        init_method = f"tcp://{ray.util.get_node_ip_address()}:{_free_port()}"
        setups = [
            a.setup.remote(model_dir, device, dtype, init_method, cpu_threads or cpus)
            for a, cpus in zip(self.actors, self.cpus, strict=True)
        ]
        join_rank0(init_method)
        ray.get(setups)
        self.loops = [a.serve.remote() for a in self.actors]

    def check(self) -> None:
        """Raises if a rank's loop ended (it died, or failed): the replica is unhealthy and Serve replaces it."""
        ended, _ = ray.wait(self.loops, num_returns=len(self.loops), timeout=0)
        for i, ref in enumerate(self.loops):
            if ref in ended:
                try:
                    ray.get(ref)
                except Exception as e:
                    raise RuntimeError(f"tensor-parallel rank {i + 1} failed: {e}") from e
                raise RuntimeError(f"tensor-parallel rank {i + 1} stopped")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_gpus(world_size: int, node_gpus: list[float]) -> None:
    """The ranks of one replica are packed on one node: some node must have that many GPUs."""
    if max(node_gpus, default=0) < world_size:
        have = ", ".join(f"{g:g}" for g in node_gpus) or "no nodes"
        raise ValueError(
            f"llm.tensor_parallel_size={world_size} needs {world_size} GPUs on one node (a replica's "
            f"ranks are packed together), but the cluster's nodes have {have} GPUs: add GPUs, lower "
            "tensor_parallel_size, or set device: cpu"
        )


def llm_placement(world_size: int, device: str) -> dict[str, Any]:
    """LLM deployment options: with N ranks, one bundle per rank, all on one node (rank 0, the replica, in the
    first); on GPUs, one GPU each, after checking that a node has them. serve_config.yaml may override these."""
    gpus = device == "cuda" or (device == "auto" and ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0)
    if gpus and ray.is_initialized():
        check_gpus(world_size, [n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]])
    if world_size == 1:
        return {}
    bundle = {"CPU": 1, "GPU": 1} if gpus else {"CPU": 1}
    return {"placement_group_bundles": [bundle] * world_size, "placement_group_strategy": "STRICT_PACK"}


__all__ = ["COLLECTIVE_TIMEOUT_S", "Rank", "Ranks", "check_gpus", "llm_placement"]
