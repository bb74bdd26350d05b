"""Training conversations about scenes (demo/scenes.py) and their padded batches: transformers' own Qwen2-VL
pipeline (chat template, image processor, each <|image_pad|> expanded to its image's token count), plus the
targets of the training-only probes (demo/supervision.py)."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoImageProcessor, PreTrainedTokenizerFast

from demo.scenes import COLOURS, SHAPES, make_scene, pair_questions
from demo.supervision import shape_cells, vision_targets

# Grounding and two pictures are the hard kinds: they get most of the samples.
KIND_WEIGHTS: dict[str, float] = {"colour": 0.14, "shape": 0.14, "count": 0.12, "grounding": 0.35, "which_image": 0.25}


def sample_conversation(rng: random.Random, max_turns: int = 4, num_objects: int | None = None,
                        answer_format=lambda answer: answer) -> dict:  # fmt: skip
    """A training conversation: one scene (or two) and 1 to max_turns questions about it, each answer labelled,
    with the shapes it is about: {"images", "objects", "turns": [(question, answer, [(picture, Shape)...])]}.

    Several questions share one image encoding: per second of CPU, ~3x the answers of single questions. The
    first turn is exactly the served (single-question) format."""
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    if rng.choices(kinds, weights)[0] == "which_image":
        while True:
            scenes = [make_scene(rng, num_objects), make_scene(rng, num_objects)]
            options = [
                (q, a, [(i, o) for o in scenes[i].objects if o.shape in q]) for q, a, i in pair_questions(*scenes)
            ]
            if options:
                break
        rng.shuffle(options)
        return {"images": [sc.image for sc in scenes], "turns": options[: rng.randint(1, max_turns)],
                "objects": [sc.objects for sc in scenes]}  # fmt: skip
    scene = make_scene(rng, num_objects)
    options = scene.questions()
    used: set[int] = (
        set()
    )  # each shape is asked about once: a later question must not be answerable from an earlier one
    turns = []
    for _ in range(rng.randint(1, max_turns)):
        left = [o for o in options if o[3] is None or id(o[3]) not in used]
        if not left:
            break
        kind = rng.choices(sorted({o[0] for o in left}), [KIND_WEIGHTS[k] for k in sorted({o[0] for o in left})])[0]
        _, question, answer, obj = rng.choice([o for o in left if o[0] == kind])
        focus = [(0, o) for o in scene.objects] if obj is None else [(0, obj)]  # a count looks at every shape
        turns.append((question, answer_format(answer), focus))
        options = [o for o in options if o[1] != question]
        if obj is not None:
            used.add(id(obj))
    return {"images": [scene.image], "turns": turns, "objects": [scene.objects]}


class Encoder:
    """Conversations -> padded batches. An item is a training conversation (above) or an eval item
    {"images", "question", "answer"} (demo/scenes.make_item)."""

    def __init__(self, checkpoint: Path, tokenizer: PreTrainedTokenizerFast, image_token_id: int):
        self.tokenizer, self.image_token_id = tokenizer, image_token_id
        self.processor = AutoImageProcessor.from_pretrained(checkpoint)
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        # The words a question picks its shape by: " red", " circle", ... (one token each in the demo tokenizer).
        self.key_words = {i for w in [*COLOURS, *SHAPES] for i in tokenizer.encode(f" {w}", add_special_tokens=False)}

    def _ids(self, item: dict, with_answers: bool) -> tuple[list[int], list[int], list[int], list[int]]:
        """-> (token ids, labels (-100 but on answer tokens), index of the answer each label belongs to, index of
        the question each of its colour and shape words belongs to); -1 where none."""
        turns = item.get("turns") or [(item["question"], item["answer"], [])]
        messages: list[dict] = []
        ids, labels, owner, asks, rendered = [], [], [], [], ""
        for k, (question, answer, _) in enumerate(turns):
            content = [{"type": "image"} for _ in item["images"]] if k == 0 else []
            messages.append({"role": "user", "content": content + [{"type": "text", "text": question}]})
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # The template renders each message on its own, so the text only grows: encode the new part.
            prompt = self.tokenizer.encode(text[len(rendered) :], add_special_tokens=False)
            ids += prompt
            labels += [-100] * len(prompt)
            owner += [-1] * len(prompt)
            asks += [k if t in self.key_words else -1 for t in prompt]
            if not with_answers:
                break
            target = self.tokenizer.encode(answer, add_special_tokens=False) + [self.im_end]
            ids += target
            labels += target
            owner += [k] * len(target)
            asks += [-1] * len(target)
            messages.append({"role": "assistant", "content": answer})
            rendered = text + answer + "<|im_end|>\n"
            newline = self.tokenizer.encode("\n", add_special_tokens=False)
            if k + 1 < len(turns):
                ids += newline
                labels += [-100] * len(newline)
                owner += [-1] * len(newline)
                asks += [-1] * len(newline)
        return ids, labels, owner, asks

    def __call__(self, items: list[dict], with_answers: bool = True) -> dict[str, torch.Tensor]:
        processed = self.processor(images=[im for it in items for im in it["images"]], return_tensors="pt")
        merge = self.processor.merge_size
        grids = iter([(h // merge, w // merge) for _, h, w in processed["image_grid_thw"].tolist()])
        rows, labels, weights, owners, row_asks, starts, row_grids = [], [], [], [], [], [], []
        for it in items:
            ids, labs, owner, asks = self._ids(it, with_answers)
            expanded, exp_labels, exp_owner, exp_asks, row_starts, these = [], [], [], [], [], []
            for tok, lab, own, ask in zip(ids, labs, owner, asks):
                n = 1
                if tok == self.image_token_id:
                    these.append(next(grids))
                    row_starts.append(len(expanded))
                    n = these[-1][0] * these[-1][1]
                expanded += [tok] * n
                exp_labels += [lab] * n
                exp_owner += [own] * n
                exp_asks += [ask] * n
            rows.append(expanded)
            labels.append(exp_labels)
            owners.append(exp_owner)
            row_asks.append(exp_asks)
            starts.append(row_starts)
            row_grids.append(these)
            # Each answer weighs the same, whatever its length: a colour (1 token) counts as much as a box (9).
            sizes = defaultdict(int)
            for own in exp_owner:
                sizes[own] += 1
            weights.append([1.0 / sizes[own] if own >= 0 else 0.0 for own in exp_owner])
        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])  # (B, T)
        batch = {
            "input_ids": input_ids,
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),  # (B, T)
            "mm_token_type_ids": (input_ids == self.image_token_id).int(),  # (B, T)
            "labels": torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels]),  # (B, T)
            "label_weights": torch.tensor([w + [0.0] * (width - len(w)) for w in weights]),  # (B, T)
            "pixel_values": processed["pixel_values"],  # (sum patches, 3*2*14*14)
            "image_grid_thw": processed["image_grid_thw"],  # (num_images, 3)
        }
        if with_answers and all("objects" in it for it in items):
            batch |= self.probe_targets(items, width, owners, row_asks, starts, row_grids)
        return batch

    @staticmethod
    def probe_targets(
        items: list[dict],
        width: int,
        owners: list[list[int]],
        asks: list[list[int]],
        starts: list[list[int]],
        grids: list[list[tuple[int, int]]],
    ) -> dict[str, torch.Tensor]:
        """The targets of demo/supervision.Probes: vision (sum tokens, 10) in the merger's order (images in turn,
        cells row-major), pictures (B, T), route_queries (B, T) and route_keys (B, T, T) (answer -> image tokens
        of its shapes), ask_queries and ask_keys (answer -> the words of its question that name them)."""
        vision, numbered = [], 0
        for it, these in zip(items, grids):
            for image, objects, grid in zip(it["images"], it["objects"], these):
                vision.append(vision_targets(image, objects, grid))
                vision[-1][:, 9] = torch.where(vision[-1][:, 9] >= 0, vision[-1][:, 9] + numbered, -1)
                numbered += len(objects)
        pictures = torch.full((len(items), width), -100)
        queries = torch.zeros(len(items), width, dtype=torch.bool)
        keys = torch.zeros(len(items), width, width, dtype=torch.bool)
        ask_queries, ask_keys = torch.zeros_like(queries), torch.zeros_like(keys)
        read_queries = torch.zeros_like(queries)
        colours, shapes, boxes = (
            torch.zeros(len(items), width, dtype=torch.long),
            torch.zeros_like(pictures),
            torch.zeros(len(items), width, 4),
        )
        for b, (it, owner, row_asks, row_starts, these) in enumerate(zip(items, owners, asks, starts, grids)):
            for p, (start, (r, c)) in enumerate(zip(row_starts, these)):
                pictures[b, start : start + r * c] = p
            for k, (_, _, focus) in enumerate(it["turns"]):
                cols = [row_starts[p] + cell for p, obj in focus
                        for cell in shape_cells(obj, it["images"][p].size, these[p])]  # fmt: skip
                # Position t predicts token t+1: the queries are the positions just before each answer token.
                positions = [t - 1 for t, own in enumerate(owner) if own == k]
                queries[b, positions] = True
                keys[b, torch.tensor(positions)[:, None], torch.tensor(cols)[None, :]] = True
                if len(focus) == 1:  # an answer about one shape
                    p, obj = focus[0]
                    w, h = it["images"][p].size
                    read_queries[b, positions] = True
                    colours[b, positions], shapes[b, positions] = (
                        list(COLOURS).index(obj.colour),
                        SHAPES.index(obj.shape),
                    )
                    boxes[b, positions] = torch.tensor([obj.box[0] / w, obj.box[1] / h, obj.box[2] / w, obj.box[3] / h])
                words = [t for t, ask in enumerate(row_asks) if ask == k]
                if words:  # a count names no shape
                    ask_queries[b, positions] = True
                    ask_keys[b, torch.tensor(positions)[:, None], torch.tensor(words)[None, :]] = True
        return {"vision_targets": torch.cat(vision), "pictures": pictures, "route_queries": queries,
                "route_keys": keys, "ask_queries": ask_queries, "ask_keys": ask_keys, "read_queries": read_queries,
                "read_colours": colours, "read_shapes": shapes, "read_boxes": boxes}  # fmt: skip


def model_inputs(batch: dict) -> dict:
    """The batch without the training targets: what the model's forward takes."""
    return {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "mm_token_type_ids",
                                                    "pixel_values", "image_grid_thw")}  # fmt: skip


__all__ = ["Encoder", "KIND_WEIGHTS", "model_inputs", "sample_conversation"]
