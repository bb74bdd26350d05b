"""Qwen3-VL in our engine against transformers on the same weights (issue 54). The decoder: Qwen3's per-head q/k
norms, the interleaved M-RoPE, and the DeepStack features each added after its layer at the image's rows, through a
chunked prefill that cuts through an image. The engine: greedy tokens equal transformers' generate with our tower's
embeddings (DeepStack levels carried beside them), whole or in chunks that cut the images, and again from the prefix
cache."""

from __future__ import annotations

import asyncio

import pytest
import torch

from demo.tiny_qwen3_vl import build_qwen3_vl_checkpoint
from encoders.qwen3_vl import Qwen3VLVisionEncoder
from llm import Qwen2LM
from llm.model import BatchMeta, ChunkSpec, cpu_kernels, merge_image_embeds, mrope_positions
from llm.model.model import TextConfig
from schemas import GenerateRequest, MediaItem, SamplingParams
from tests.llm.reference import Case, collect, make_engine, reference_generate, request_for

GRIDS = [(1, 4, 6), (1, 6, 4)]  # two images of 6 merged tokens each (merge 2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # NOTE: seed 2: there, the greedy tokens of the engine test change from the first one when the DeepStack
    # features are zeroed (seed 0's do not: a test on it could not see a dropped level)
    return build_qwen3_vl_checkpoint(tmp_path_factory.mktemp("qwen3-vl") / "tiny", seed=2)


@pytest.fixture(scope="module")
def reference(ckpt):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def case(reference):
    """Token ids with one placeholder run per image, random embeddings and DeepStack features for them (the LM is
    under test here, not the tower), and transformers' logits for them."""
    cfg = reference.config
    ids = [3, 4, 5]
    for t, h, w in GRIDS:
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (t * h * w // 4) + [cfg.vision_end_token_id, 6, 7]
    ids = torch.tensor(ids)
    mask = ids == cfg.image_token_id
    n, d = int(mask.sum()), cfg.text_config.hidden_size
    levels = len(cfg.vision_config.deepstack_visual_indexes)
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(n, d, generator=gen)
    features = torch.randn(n, levels, d, generator=gen)  # (rows, levels, D)
    with torch.no_grad():
        positions, _ = reference.model.get_rope_index(
            ids[None], mm_token_type_ids=mask.int()[None], image_grid_thw=torch.tensor(GRIDS)
        )
        lm = reference.model.language_model
        x = lm.embed_tokens(ids[None]).clone()
        x[0, mask] = embeds
        hidden = lm(
            inputs_embeds=x,
            position_ids=positions,
            visual_pos_masks=mask[None],
            deepstack_visual_embeds=[features[:, k] for k in range(levels)],
        ).last_hidden_state
        logits = reference.lm_head(hidden)[0]
    return ids, mask, embeds, features, positions[:, 0], logits


def _prefill(model, ids, mask, embeds, features, positions, cuts, deepstack=True):
    """Prefill in chunks [0, c1), [c1, c2), ...: each chunk's image rows get their features (rows of the chunk)."""
    x = merge_image_embeds(model.embed(ids), mask, embeds)
    image_row = torch.cumsum(mask, 0) - 1  # a prompt row's index among the image rows
    T, block = len(ids), 4
    cache = model.new_cache(-(-T // block) + 1, block)
    out, bounds = [], [0, *cuts, T]
    for a, b in zip(bounds, bounds[1:]):
        meta = BatchMeta.build([ChunkSpec(list(range(cache.num_blocks)), a, b - a)], block, x.device)
        rows = mask[a:b].nonzero().flatten()
        stack = (rows, features[image_row[a:b][rows]]) if deepstack and len(rows) else None
        out.append(model(x[a:b], positions[:, a:b], cache, meta, deepstack=stack))
    return model.logits(torch.cat(out))


def test_the_config_reads_qwen3s_norms_and_interleaved_m_rope(ckpt, reference):
    c = TextConfig.from_hf(reference.config)
    assert c.qk_norm and c.mrope_interleaved and c.mrope_section == (4, 2, 2) and not c.qkv_bias


def test_our_positions_are_transformers(case, reference):
    ids, mask, _, _, positions, _ = case
    ours, _ = mrope_positions(ids, reference.config.image_token_id, GRIDS, merge_size=2)
    assert torch.equal(ours, positions)


@pytest.mark.parametrize("ops", ["cpu kernels", "torch ops"])
@pytest.mark.parametrize("cuts", [[], [8, 11], [5, 9, 10, 20]], ids=["whole", "cut in an image", "cuts"])
def test_prefill_logits_match_transformers(ckpt, case, ops, cuts, monkeypatch):
    """Chunk cuts inside an image run: each level is added once, to the rows of the chunk that holds them."""
    assert cpu_kernels.load() is not None
    if ops == "torch ops":
        monkeypatch.setattr(cpu_kernels, "_module", None)
    ids, mask, embeds, features, positions, ref = case
    model = Qwen2LM.from_pretrained(ckpt)
    with torch.no_grad():
        ours = _prefill(model, ids, mask, embeds, features, positions, cuts)
    torch.testing.assert_close(ours, ref, atol=5e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_the_deepstack_features_matter(ckpt, case):
    """Without them (or with a level dropped) the logits are not transformers': the comparison above can fail."""
    ids, mask, embeds, features, positions, ref = case
    model = Qwen2LM.from_pretrained(ckpt)
    with torch.no_grad():
        none = _prefill(model, ids, mask, embeds, features, positions, [], deepstack=False)
        one = _prefill(model, ids, mask, embeds, features[:, :1], positions, [])
    for logits in (none, one):
        assert (logits - ref).abs().max() > 1e-2


@pytest.mark.parametrize("budget", [1024, 7], ids=["whole prefill", "chunks of 7: cuts inside each image"])
def test_greedy_tokens_equal_transformers_through_the_engine(ckpt, reference, budget):
    """Our tower's embeddings carry the DeepStack levels (encoders/qwen3_vl.py); the engine splits them off, merges
    the first D columns and hands the rest to the decoder for the rows of each chunk (llm/engine/model_runner.py).
    The second run of the same prompt comes from the prefix cache: no features needed, the same tokens."""
    model, vision = Qwen2LM.from_pretrained(ckpt), Qwen3VLVisionEncoder(ckpt)
    case, ref = request_for(ckpt, reference, vision, [(120, 80), (64, 200)], seed=1, prefix=[3, 4, 5], max_tokens=8)
    assert [e.shape[1] for e in case.embeds] == [3 * 64] * 2  # merged embeddings + 2 levels
    expected = reference_generate(reference, ref, 8)
    engine = make_engine(model, reference, max_num_batched_tokens=budget, max_model_len=512, num_blocks=64)
    try:
        assert asyncio.run(collect(engine, case))[0] == expected
        again = case.replace(request_id="again")
        assert asyncio.run(collect(engine, again))[0] == expected
        assert engine.stats()["prefix_hits"] > 0
        # the features are what makes them transformers': without them (zeroed), other tokens
        flat = case.replace(request_id="flat", embeds=[torch.cat([e[:, :64], 0 * e[:, 64:]], 1) for e in case.embeds])
        assert asyncio.run(collect(engine, flat))[0] != expected
    finally:
        engine.close()


def test_two_sequences_in_one_step_each_get_their_own_features(ckpt, reference):
    """Two prompts with images prefilled in the same steps: each chunk's DeepStack rows are offset by the rows before
    it in the batch (a decode row, another prompt's chunk)."""
    model, vision = Qwen2LM.from_pretrained(ckpt), Qwen3VLVisionEncoder(ckpt)
    cases = [
        request_for(ckpt, reference, vision, sizes, seed=seed, prefix=prefix, max_tokens=6)
        for sizes, seed, prefix in (([(120, 80)], 3, [3, 4]), ([(64, 200), (90, 90)], 4, [5, 6, 7]))
    ]
    expected = [reference_generate(reference, ref, 6) for _, ref in cases]
    engine = make_engine(model, reference, max_num_batched_tokens=64, max_model_len=512, num_blocks=64)

    async def both():
        return await asyncio.gather(*(collect(engine, case) for case, _ in cases))

    try:
        assert [ids for ids, _ in asyncio.run(both())] == expected
    finally:
        engine.close()


def _video_case(ckpt, reference, vision, *, seed: int, budget_frames: int = 6):
    """A Qwen3-VL video as the ingress lays it out: each tubelet's `<t seconds>` text, then its run in vision
    markers, all inside the template's markers (transformers' Qwen3VLProcessor writes the same); our tower's
    embedding of the frames (DeepStack levels beside it) for the engine, the same pixels for transformers."""
    from transformers import AutoTokenizer

    from encoders.video_processing import Qwen3VLVideoProcessing, SamplingRequest, VideoMeta

    cfg, tokenizer = reference.config, AutoTokenizer.from_pretrained(ckpt)
    proc = Qwen3VLVideoProcessing.from_pretrained(ckpt)
    plan = proc.plan(VideoMeta(8 * budget_frames // 2, 8.0, 160, 120), SamplingRequest(), 1 << 30)
    frames = torch.randint(
        0,
        256,
        (len(plan.indices), plan.height, plan.width, 3),
        generator=torch.Generator().manual_seed(seed),
        dtype=torch.uint8,
    )
    pixel_values, grid = proc.preprocess(frames.numpy())
    ids = [3, 4, cfg.vision_start_token_id]
    per = plan.num_tokens // grid[0]
    for seconds in plan.timestamps:
        ids += tokenizer.encode(proc.timestamp_text(seconds), add_special_tokens=False)
        ids += [cfg.vision_start_token_id] + [cfg.video_token_id] * per + [cfg.vision_end_token_id]
    ids += [cfg.vision_end_token_id, 14, 15]
    embeds = vision.forward([(pixel_values, grid)])
    item = MediaItem(
        f"video-{seed}", grid, plan.num_tokens, cfg.video_token_id, plan.second_per_grid_t, tubelet_runs=True
    )
    request = GenerateRequest(request_id=f"v{seed}", prompt_token_ids=ids, items=[item],
                              sampling=SamplingParams(max_tokens=8, temperature=0.0))  # fmt: skip
    input_ids = torch.tensor([ids])
    ref = {"input_ids": input_ids, "pixel_values_videos": pixel_values, "video_grid_thw": torch.tensor([grid])}
    return Case(request, embeds), ref, plan


def _reference_video_generate(reference, ref: dict, max_new_tokens: int) -> list[int]:
    input_ids = ref["input_ids"]
    types = 2 * (input_ids == reference.config.video_token_id).int()
    with torch.no_grad():
        out = reference.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=types,
            pixel_values_videos=ref["pixel_values_videos"], video_grid_thw=ref["video_grid_thw"],
            do_sample=False, max_new_tokens=max_new_tokens,
        )  # fmt: skip
    return out[0, input_ids.shape[1] :].tolist()


def test_a_videos_positions_are_transformers(ckpt, reference):
    """A video's tubelets each placed as an image of one tubelet, the timestamps' text between them (transformers'
    get_rope_index splits video_grid_thw so): red with the video taken as one run of its whole grid."""
    from llm.engine.sequence import make_sequence

    case, ref, plan = _video_case(ckpt, reference, Qwen3VLVisionEncoder(ckpt), seed=5)
    types = 2 * (ref["input_ids"] == reference.config.video_token_id).int()
    expected, _ = reference.model.get_rope_index(ref["input_ids"], types, video_grid_thw=ref["video_grid_thw"])
    lm = Qwen2LM.from_pretrained(ckpt).config
    seq = make_sequence(case.request, [None], 0, max_model_len=512, image_token_id=reference.config.image_token_id,
                        merge_size=2, lm_config=lm, device=torch.device("cpu"),
                        video_token_id=reference.config.video_token_id)  # fmt: skip
    assert torch.equal(seq.prompt_positions, expected[:, 0])
    assert len(seq.image_spans) == plan.grid_thw[0] and seq.item_runs == [range(plan.grid_thw[0])]
    # Its embedding arriving later fills the runs in order, each its tubelet's rows.
    assert seq.num_missing == 3 and seq.num_schedulable(0) == seq.image_spans[0][0]
    seq.set_image(0, case.embeds[0])
    per = plan.num_tokens // 3
    assert seq.num_missing == 0 and all(torch.equal(x, case.embeds[0][r * per : (r + 1) * per])
                                        for r, x in enumerate(seq.image_embeds))  # fmt: skip


@pytest.mark.parametrize("budget", [1024, 7], ids=["whole prefill", "chunks of 7: cuts inside and between runs"])
def test_a_videos_greedy_tokens_equal_transformers_through_the_engine(ckpt, reference, budget):
    """One video's embedding (its tubelets' rows in order, DeepStack levels beside) fills the runs between the
    timestamps; again from the prefix cache; another video gives other tokens, still transformers'."""
    from llm import Engine, EngineConfig

    model, vision = Qwen2LM.from_pretrained(ckpt), Qwen3VLVisionEncoder(ckpt)
    config = EngineConfig(max_model_len=512, num_blocks=64, block_size=16, max_queued=16, max_num_batched_tokens=budget)
    engine = Engine(model, config, image_token_id=reference.config.image_token_id, merge_size=2,
                    eos_token_ids=set(reference.generation_config.eos_token_id),
                    video_token_id=reference.config.video_token_id)  # fmt: skip
    try:
        case, ref, plan = _video_case(ckpt, reference, vision, seed=5)
        assert plan.grid_thw[0] == 3 and case.embeds[0].shape == (plan.num_tokens, 3 * 64)
        expected = _reference_video_generate(reference, ref, 8)
        assert asyncio.run(collect(engine, case))[0] == expected
        assert asyncio.run(collect(engine, case.replace(request_id="again")))[0] == expected
        assert engine.stats()["prefix_hits"] > 0
        other, other_ref, _ = _video_case(ckpt, reference, vision, seed=6)
        other_tokens = asyncio.run(collect(engine, other))[0]
        assert other_tokens == _reference_video_generate(reference, other_ref, 8) and other_tokens != expected
    finally:
        engine.close()


def test_the_static_decode_step_serves_qwen3(ckpt, reference):
    """The decode step a CUDA graph captures (static shapes, run here on the CPU without the graph): Qwen3's q/k
    norms inside it, no host sync, and greedy tokens after images (DeepStack in the prefill) equal transformers'."""
    from llm.engine.decode_step import StaticDecode
    from tests.llm.test_decode_step import _filled, _NoHostSync

    model, vision = Qwen2LM.from_pretrained(ckpt), Qwen3VLVisionEncoder(ckpt)
    with torch.inference_mode():
        cache, blocks = _filled(model, [3, 10, 40], seed=1)
        static = StaticDecode(model, cache, max_num_seqs=8, max_model_len=96, cuda_graphs=False)
        rows = static.prepare([5, 6, 7], [3, 10, 40], blocks, [4, 11, 41])
        with _NoHostSync():
            static.forward(rows)
    case, ref = request_for(ckpt, reference, vision, [(120, 80), (64, 200)], seed=1, prefix=[3, 4, 5], max_tokens=12)
    engine = make_engine(model, reference, static_decode=True)
    try:
        assert engine.runner.static is not None
        assert asyncio.run(collect(engine, case))[0] == reference_generate(reference, ref, 12)
    finally:
        engine.close()
