"""`build_app(args)`: the application graph, Ingress -> (Encoder, LLM), from `args:`."""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from deployments.encoder.server import Encoder
from deployments.ingress import Ingress
from deployments.llm.server import LLM
from deployments.llm.tp import llm_placement
from encoders import ModelSpec
from encoders.checkpoint_config import plain_config
from llm import TextConfig
from llm.model.parallel import check_divisible
from schemas import AppArgs


def build_app(args: dict[str, Any]) -> Application:
    """Validated here, once, so a bad config fails at deploy time with the field named, not in a replica."""
    app_args = AppArgs.model_validate(args)
    spec = ModelSpec.from_args(app_args)  # an unsupported checkpoint or context fails here, saying why
    tp = app_args.llm.tensor_parallel_size
    if tp > 1:  # the heads and the MLP must split evenly over the ranks
        text = TextConfig.from_hf(spec.hf_config)
        try:
            check_divisible(text.num_heads, text.num_kv_heads, text.intermediate_size, tp)
        except ValueError as e:
            raise ValueError(f"llm.tensor_parallel_size: {e}") from None
    plain = app_args.model_dump()
    llm = LLM.options(**llm_placement(tp, app_args.device)).bind(plain)  # GPUs checked, ranks packed on one node
    if app_args.encoder.colocated:  # no encoder tier: the LLM replica encodes the images itself
        return Ingress.bind(None, llm, plain)
    # the config as data: a new Encoder replica then imports no transformers (encoders/checkpoint_config.py)
    return Ingress.bind(Encoder.bind(plain, config=plain_config(spec.hf_config)), llm, plain)
