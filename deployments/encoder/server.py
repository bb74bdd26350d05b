"""Encoder deployment: image bytes in, projected embeddings (num_image_tokens, llm_hidden) out.

Serve autoscales this deployment on its own; the ingress fans each request's images out to it, as many to a call as
one ViT forward takes, and keeps the references to what comes back (its embedding cache: the ingress's, keyed where
the key is known). Images of concurrent calls are packed into one ViT forward (`encoders.ImageBatcher`)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from ray import serve
from ray.serve.config import RequestRouterConfig

from deployments.encoder import IMPORTS_BEGAN
from deployments.encoder.autoscaling import (
    ARRIVING_COST,
    AUTOSCALING,
    MEAN_COST,
    PENDING_COST,
    TARGET_COST,
    ArrivalMeter,
)
from deployments.encoder.router import CostRouter
from deployments.errors import quiet_client_errors
from deployments.metrics import EncoderMetrics, heap_census
from deployments.ray_private import idle_workers, my_raylet, prestart_workers
from deployments.replica import DRAIN_POLL_S, StartTimeline, this_replica
from deployments.transfer import send_tensors_out_of_band
from encoders import EncoderRunner, ModelSpec, VisionEncoder
from encoders.checkpoint_config import ConfigView
from encoders.startup_checks import StartupChecks
from encoders.video_decode import Video
from schemas import AppArgs, EncoderArgs, InvalidRequest

logger = logging.getLogger("ray.serve")
GAUGE_EVERY_S = 10.0
DEFAULT_TARGET_COST = 10.0  # GFLOP: about 0.4 s of a 2-core CPU replica on the demo model
WARM_KEEP_ALIVE_S = 3600  # how long the raylet keeps a warm worker above its idle limit (then it may reap it)
WARM_EVERY_S = 5.0  # how often a replica tops its node's warm workers up


class EncoderReplica:
    """The Encoder deployment's class (`Encoder` below). NOTE: a module attribute of its own, so that Serve's pickle of
    the deployment names it (by reference) instead of copying it: a new replica then imports this module first, as
    its start's timeline assumes, and the class's globals are this module's, not the driver's values."""

    def __init__(
        self,
        args: dict[str, Any],
        model_factory: Callable[..., VisionEncoder] | None = None,
        *,
        config: dict[str, Any] | None = None,
    ):
        """`config`: the checkpoint's config as the app builder resolved it (`plain_config`); without it, this replica
        reads config.json through transformers (~0.8 CPU-s more imports in its start)."""
        self.start = StartTimeline(IMPORTS_BEGAN, IMPORTED)
        self.start.mark("waiting")
        self.args = AppArgs.model_validate(args)
        quiet_client_errors()  # a bad image is one WARNING line, not an ERROR traceback
        send_tensors_out_of_band()
        if self.args.encoder.cpu_threads is not None:  # process-wide: the worker threads that encode take it too
            torch.set_num_threads(self.args.encoder.cpu_threads)
        spec = ModelSpec.from_args(self.args, ConfigView(config) if config is not None else None)
        self.metrics = EncoderMetrics()
        self.runner = EncoderRunner(
            spec,
            self.args.encoder,
            model_factory=model_factory,
            on_batch=self.metrics.on_batch,
            video=self.args.video,
            on_video=self.metrics.video_decode.observe,
            checks=StartupChecks(),  # this node's, shared by its replicas
            on_phase=self.start.mark,
        )
        self._exporter: asyncio.Task | None = None  # re-sets the gauges, from the first image on
        self.num_cancelled = 0
        self.pending_cost = 0.0  # GFLOP of the images queued and running here (the autoscaling metric)
        self.arrivals = ArrivalMeter()  # GFLOP of the images that came to be encoded here, lately
        self.target_cost = self._target_cost(self.args.encoder, self.runner.gflops)
        threads = torch.get_num_threads()
        logger.info("encoder ready: %s on %s (%s), %d CPU threads", self.args.model, spec.device, spec.dtype, threads)
        if self.args.encoder.warm_workers and (replica := this_replica()) is not None:  # not a test's bare class
            threading.Thread(target=self._keep_warm_workers, args=(replica,), name="warm-workers", daemon=True).start()

    def _keep_warm_workers(self, replica: str) -> None:
        """Keeps this node topped up to `encoder.warm_workers` idle worker processes for the next replicas to start
        in, from its start on and every WARM_EVERY_S while it has no image to encode (a start there, of any
        deployment, takes one): their start is then Serve's and this module's work, not a new interpreter's and
        torch's imports. Not while it encodes: a new process's imports take ~2 CPU-s from the images (kept topped up
        under the bench's load step, the 2-core VM ran a fourth replica in three runs of four). Two, so that the
        second and third replicas of a step both start warm. Best effort: a replica serves without."""
        warned, raylet = False, my_raylet()
        while this_replica() == replica:  # as long as this process is this replica (a test's bare class: its test)
            try:
                wanted = self.args.encoder.warm_workers
                if self.pending_cost <= 0 and (count := wanted - len(idle_workers(raylet=raylet))) > 0:
                    prestart_workers(count, WARM_KEEP_ALIVE_S)
                    logger.info("encoder replica started %d warm worker process(es) on its node", count)
            except Exception as e:  # the raylet busy or another Ray: the next start is a cold one
                log = logger.debug if warned else logger.warning
                log("encoder replica could not leave warm worker processes (%s: %s)", type(e).__name__, e)
                warned = True
            time.sleep(WARM_EVERY_S)

    @staticmethod
    def _target_cost(opts: EncoderArgs, gflops: float | None) -> float:
        """The cost policy's target for one replica: as set, else what this replica encodes in the target delay."""
        if opts.target_cost_per_replica is not None:
            target, why = opts.target_cost_per_replica, "set"
        elif gflops is not None:
            target, why = gflops * opts.target_queue_delay_s, f"{gflops:.1f} GFLOP/s x {opts.target_queue_delay_s:g} s"
        else:
            target, why = DEFAULT_TARGET_COST, "no start-up check to measure this replica: the fixed default"
        logger.info("encoder autoscaling: target %.2f GFLOP per replica (%s)", target, why)
        return target

    async def encode(self, jobs: list[bytes | Video], cost: float | None = None) -> list[torch.Tensor | InvalidRequest]:
        """Images' bytes or videos (encoders.video_decode.Video; a chunk of one's tubelets) -> each one's
        (num_tokens, llm_hidden) embedding, or the client's error with it (an image that does not decode fails
        alone, not the call: the other images of the call are good). `cost`: the jobs' encoding cost
        (encoders/cost.py), which the callers' router routes on and which counts here as pending until the call
        ends (a call without one counts nothing)."""
        # NOTE: returned, not ray.put: the caller owns the result, so it outlives this replica.
        self._add_pending(cost or 0.0)
        if cost:  # the leading signal
            self.arrivals.add(cost)
        try:
            return list(await asyncio.gather(*(self._one(job) for job in jobs)))
        except asyncio.CancelledError:  # the client went away: images still queued leave the batch unencoded
            self.num_cancelled += len(jobs)
            self.metrics.cancelled.inc(len(jobs))
            raise
        finally:
            self._add_pending(-(cost or 0.0))

    async def _one(self, job: bytes | Video) -> torch.Tensor | InvalidRequest:
        try:
            out = await self.runner.encode(job)
            if self.start.mark("first_image"):
                self._exporter = asyncio.create_task(self._export_gauges())
                logger.info("encoder replica served its first image %s", self.start.describe())
            return out
        except InvalidRequest as e:
            logger.warning("a client's image could not be encoded (%d): %s", e.status, e.message)
            return e

    async def _export_gauges(self) -> None:
        """The gauges set once (the start's phases) or rarely (pending cost), set again every GAUGE_EVERY_S: Ray's
        metrics agent drops a series that was not set for about 30 s (a dashboard lost a replica's start then)."""
        while True:
            self.metrics.on_started(self.start)
            self.metrics.pending_cost.set(max(0.0, self.pending_cost))
            await asyncio.sleep(GAUGE_EVERY_S)

    def _add_pending(self, cost: float) -> None:
        self.pending_cost += cost
        self.metrics.pending_cost.set(max(0.0, self.pending_cost))
        if cost > 0:  # NOTE: Ray counters refuse inc(0)
            self.metrics.cost.inc(cost)

    async def stats(self) -> dict[str, float]:
        return {**self.runner.stats(), "cancelled": self.num_cancelled, "target_cost": self.target_cost}

    async def heap(self) -> dict[str, Any]:
        return heap_census()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics, read by the cost policy (deployments/encoder/autoscaling.py)."""
        opts = self.args.encoder
        return {
            PENDING_COST: max(0.0, self.pending_cost),
            ARRIVING_COST: self.arrivals.rate() * opts.target_queue_delay_s / opts.target_utilization,
            MEAN_COST: self.arrivals.mean(),
            TARGET_COST: self.target_cost,
        }


IMPORTED = time.time()  # this module's imports are done


# NOTE: the router (it runs in the callers, the ingress replicas) is set here, as the LLM's: `serve deploy` imports a
# class path named in the YAML on the client.
Encoder = serve.deployment(
    name="Encoder",
    ray_actor_options={"num_cpus": 0.4},
    max_ongoing_requests=16,
    request_router_config=RequestRouterConfig(request_router_class=CostRouter),
    autoscaling_config=AUTOSCALING,  # on cost (deployments/encoder/autoscaling.py)
    graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
)(EncoderReplica)
