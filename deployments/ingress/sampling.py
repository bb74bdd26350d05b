"""A request's sampling fields -> the engine's SamplingParams of one choice, with the checkpoint's defaults."""

from __future__ import annotations

from schemas import SamplingParams
from schemas.requests import GenerationRequest


def sampling_params(
    req: GenerationRequest, max_tokens: int, choice: int, grammar: str | None, defaults: dict[str, float]
) -> SamplingParams:
    """The engine's parameters of choice `choice`; a field the request leaves out takes `defaults`' value (the
    checkpoint's generation_config.json, ModelSpec.sampling_defaults) where it has one, else the API's default."""
    seed = None if req.seed is None else (req.seed + choice) % 2**63  # n choices differ, each reproducible

    def pick(name: str, default: float) -> float:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, default)

    temperature = pick("temperature", 1.0)
    return SamplingParams(
        max_tokens=max_tokens,
        # NOTE: as vLLM (_SAMPLING_EPS): below 1e-5 is greedy. Checkpoints ask for 1e-6 in generation_config.json, and
        # a float32 row divided by a subnormal temperature is inf and NaN.
        temperature=temperature if temperature >= 1e-5 else 0.0,
        top_p=pick("top_p", 1.0),
        top_k=max(int(pick("top_k", 0)), 0),
        seed=seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=pick("repetition_penalty", 1.0),
        min_p=pick("min_p", 0.0),
        min_tokens=req.min_tokens,
        logit_bias=dict(req.logit_bias),
        stop_token_ids=frozenset(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        logprobs=req.num_logprobs is not None,
        top_logprobs=req.num_logprobs or 0,
        # NOTE: a prompt's first choice alone computes them (they bypass the prefix cache); its n choices share them.
        prompt_logprobs=req.num_prompt_logprobs if choice == 0 else None,
        grammar=grammar,
    )


__all__ = ["sampling_params"]
