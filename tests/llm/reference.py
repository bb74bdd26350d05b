"""Engine requests and the transformers reference for the same prompt (shared by the engine tests)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from demo.inputs import make_image
from llm import Engine, EngineConfig
from llm.engine.sampling import RowState
from schemas import GenerateRequest, MediaItem, SamplingParams


@dataclass
class Case:
    """What `Engine.submit` takes for one sequence: the request, and one embedding per item (a (num_tokens, D)
    tensor, or an asyncio.Future of it: an image still being encoded)."""

    request: GenerateRequest
    embeds: list = field(default_factory=list)

    def replace(self, **changes) -> Case:
        """A copy with `changes` to the request's fields, or to `embeds`."""
        embeds = changes.pop("embeds", self.embeds)
        return Case(dataclasses.replace(self.request, **changes), list(embeds))


def text_case(request_id: str, prompt: list[int], params: SamplingParams) -> Case:
    return Case(GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=params))


def make_engine(model, reference, load_tokenizer=None, **kw) -> Engine:
    """`load_tokenizer`: for structured outputs (grammars are refused without it)."""
    config = EngineConfig(**{"max_model_len": 512, "num_blocks": 128, "block_size": 16, "max_queued": 16, **kw})
    eos = reference.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}  # Qwen's a list, LLaVA's one id
    return Engine(
        model,
        config,
        image_token_id=reference.config.image_token_id,
        merge_size=2,
        eos_token_ids=eos,
        load_tokenizer=load_tokenizer,
    )


def states_for(params: list[SamplingParams], vocab_size: int, prompt: list[int] = (), stops=frozenset()):
    """Each row's logits state at its first sampling (`sample`'s `states`), on the CPU."""
    return [RowState.start(p, list(prompt), frozenset(stops), vocab_size, torch.device("cpu")) for p in params]


def request_for(
    checkpoint, reference, vision, sizes, *, seed: int, prefix: list[int], max_tokens: int = 12, **sampling
) -> tuple[Case, dict]:
    """A prompt `prefix` + one placeholder run per image (framed like the chat template frames them)."""
    cfg = reference.config
    images = [make_image(w, h, seed=seed * 10 + i) for i, (w, h) in enumerate(sizes)]
    ids, grids, ref = list(prefix), [], {}
    if images:
        processed = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)(images=images, return_tensors="pt")
        ref = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
        for grid in processed["image_grid_thw"].tolist():
            grids.append(tuple(grid))
            ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (grid[1] * grid[2] // 4)
            ids += [cfg.vision_end_token_id, 14]
    embeds = vision.encode(images) if images else []
    params = SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, **sampling})
    items = [
        MediaItem(f"image-{seed}-{i}", g, g[0] * g[1] * g[2] // 4, cfg.image_token_id) for i, g in enumerate(grids)
    ]
    ref["input_ids"] = torch.tensor([ids])
    return Case(GenerateRequest(request_id=f"r{seed}", prompt_token_ids=ids, sampling=params, items=items), embeds), ref


def reference_generate(reference, ref: dict, max_new_tokens: int, **kw):
    input_ids = ref["input_ids"]
    extra = {k: v for k, v in ref.items() if k != "input_ids"}
    with torch.no_grad():
        out = reference.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=(input_ids == reference.config.image_token_id).int(),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            **extra,
            **kw,
        )
    if kw.get("return_dict_in_generate"):
        return out
    return out[0, input_ids.shape[1] :].tolist()


async def collect(engine: Engine, inp: Case | GenerateRequest) -> tuple[list[int], str | None]:
    """A sequence's tokens and finish reason (a bare request: text only)."""
    case = inp if isinstance(inp, Case) else Case(inp)
    ids, finish = [], None
    async for chunk in engine.generate(case.request, case.embeds):
        ids += chunk.token_ids
        finish = chunk.finish_reason
    return ids, finish
