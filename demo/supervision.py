"""Training-only signals for demo/train.py: probes and an attention target that teach a from-scratch tiny VLM, in
the minutes a CPU gives, what its answers alone teach it only after thousands of steps. None of it is saved: the
checkpoint is a plain Qwen2-VL.

- `VisionProbe`: per image token (the merger's output), the colour and shape under it, the number of shapes, the
  token's place in the picture and its shape's box. Dense labels: the ViT learns to see in a few hundred steps.
- `route_loss`: one attention head of the LM (`ROUTE_LAYER`, head 0) is told where to look while it writes an
  answer: at the image tokens of the shape the question names (of the picture that has it; every shape for a
  count). This is the step that does not form on its own within the budget: finding the right token among 60.
  The idea is the supervised attention of "Supervising Neural Attention Models for Video Captioning by Human
  Gaze Data" (Yu et al., 2017) and of later grounding work; the code is ours.
- `route_loss(layer=0)`, "ask": head 0 of the first layer looks, from the same positions, at the words of the
  question that name the shape ("red", "circle"), so that the routed head above has them to ask with.
- `read_loss`: after the routed layer, the hidden state of an answer's position about one shape names that
  shape's colour, kind and box: what the answer has to say, where the last layer can say it.
- `picture_loss`: the LM's hidden state of each image token after its first layer tells which picture (first or
  second) it belongs to, so that the routed head reads "first" or "second" from the tokens it attends to.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from demo.scenes import COLOURS, SHAPES, Shape, coverage

ROUTE_LAYER = 1  # of the text model's layers; the head is 0
ROUTE_COVER = 0.15  # share of a cell a shape must cover for the routed head to look at the cell
LABEL_COVER, BACKGROUND_COVER = 0.3, 0.05  # a cell is the shape's above the first, background below the second


def cell_cover(obj: Shape, size: tuple[int, int], grid: tuple[int, int]) -> np.ndarray:
    """(rows*cols,) row-major: the share of each merged cell (grid = (rows, cols)) that the shape covers."""
    (w, h), (rows, cols) = size, grid
    ys = np.round(np.arange(rows) * h / rows).astype(int)  # each cell row's first pixel row
    xs = np.round(np.arange(cols) * w / cols).astype(int)
    sums = np.add.reduceat(np.add.reduceat(coverage(obj, size), ys, axis=0), xs, axis=1)  # (rows, cols)
    areas = np.diff(np.append(ys, h))[:, None] * np.diff(np.append(xs, w))[None, :]  # (rows, cols)
    return (sums / areas).reshape(-1)


def shape_cells(obj: Shape, size: tuple[int, int], grid: tuple[int, int]) -> list[int]:
    """Row-major indices of the merged cells the shape covers by at least ROUTE_COVER, or its most covered cell
    when none is (a small shape on a coarse grid)."""
    cover = cell_cover(obj, size, grid)
    return np.flatnonzero(cover >= ROUTE_COVER).tolist() or [int(cover.argmax())]


def vision_targets(image: Image.Image, objects: list[Shape], grid: tuple[int, int]) -> torch.Tensor:
    """(rows*cols, 10) per merged cell: colour id, shape id (background: the last id of each; -100 for a cell
    partly covered, neither), shapes - 1, the cell's centre (x, y in 0..1), its shape's box (0..1, -1 if none)
    and the index of that shape in `objects` (-1 if none)."""
    w, h = image.size
    rows, cols = grid
    cy = ((torch.arange(rows, dtype=torch.float32) + 0.5) / rows)[:, None].expand(rows, cols).reshape(-1)  # (N,)
    cx = ((torch.arange(cols, dtype=torch.float32) + 0.5) / cols)[None, :].expand(rows, cols).reshape(-1)  # (N,)
    target = torch.full((rows * cols, 10), -1.0)
    target[:, 0], target[:, 1], target[:, 2] = len(COLOURS), len(SHAPES), len(objects) - 1
    target[:, 3], target[:, 4] = cx, cy
    covers = torch.tensor(np.stack([cell_cover(obj, image.size, grid) for obj in objects]))  # (objects, N)
    best, which = covers.max(0)  # (N,), (N,)
    target[(best >= BACKGROUND_COVER) & (best < LABEL_COVER), :2] = -100
    for i, obj in enumerate(objects):
        mine = (which == i) & (best >= LABEL_COVER)  # (N,)
        x1, y1, x2, y2 = obj.box
        target[mine, 0], target[mine, 1] = list(COLOURS).index(obj.colour), SHAPES.index(obj.shape)
        target[mine, 5:9] = torch.tensor([x1 / w, y1 / h, x2 / w, y2 / h])
        target[mine, 9] = i
    return target


class Probes(torch.nn.Module):
    """The training-only heads, fed by forward hooks on the model: call `losses(batch)` after a forward."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        hidden = model.config.text_config.hidden_size
        self.vision = torch.nn.Linear(hidden, len(COLOURS) + 1 + len(SHAPES) + 1 + 3 + 2 + 4)
        self.picture = torch.nn.Linear(hidden, 2)
        self.pooled = torch.nn.Linear(hidden, len(SHAPES))
        self.answer = torch.nn.Linear(hidden, len(COLOURS) + len(SHAPES) + 4)
        self.seen: dict[str, torch.Tensor] = {}
        text = model.model.language_model
        if text.config._attn_implementation != "eager":
            raise ValueError("route_loss needs the attention weights: build the text model with eager attention")
        model.model.visual.register_forward_hook(lambda m, a, out: self.seen.__setitem__("image", out.pooler_output))
        text.layers[0].register_forward_hook(lambda m, a, out: self.seen.__setitem__("layer0", out))
        text.layers[ROUTE_LAYER].register_forward_hook(lambda m, a, out: self.seen.__setitem__("routed", out))
        for layer in {0, ROUTE_LAYER}:
            text.layers[layer].self_attn.register_forward_hook(
                lambda m, a, out, layer=layer: self.seen.__setitem__(f"attn{layer}", out[1])
            )

    def vision_loss(self, targets: torch.Tensor) -> torch.Tensor:
        """targets (N, 10) from vision_targets, their object column numbered across the batch."""
        image = self.seen["image"]  # (N, hidden)
        out = self.vision(image)  # (N, 27)
        nc, ns = len(COLOURS) + 1, len(SHAPES) + 1
        colour, shape, count = out[:, :nc], out[:, nc : nc + ns], out[:, nc + ns : nc + ns + 3]
        where, box = out[:, nc + ns + 3 : nc + ns + 5], out[:, nc + ns + 5 :]  # (N, 2), (N, 4)
        on_shape = targets[:, 9] >= 0  # (N,)
        labelled = (targets[:, 1] >= 0) & (targets[:, 1] < len(SHAPES))  # (N,) cells of a shape
        self.seen["shape_accuracy"] = (shape.argmax(-1) == targets[:, 1].long())[labelled].float().mean().detach()
        loss = F.cross_entropy(colour, targets[:, 0].long(), ignore_index=-100)
        loss = loss + 2 * F.cross_entropy(shape, targets[:, 1].long(), ignore_index=-100)
        loss = loss + F.cross_entropy(count, targets[:, 2].long()) + 5 * F.l1_loss(where, targets[:, 3:5])
        if on_shape.any():
            loss = loss + 10 * F.l1_loss(box[on_shape], targets[on_shape, 5:9])
            # The mean of a shape's tokens names it: what the LM reads when it attends to all of them.
            ids = targets[on_shape, 9].long()  # (M,)
            pooled = torch.zeros(int(ids.max()) + 1, image.shape[1]).index_add_(0, ids, image[on_shape])
            counts = torch.zeros(pooled.shape[0]).index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
            labels = torch.full((pooled.shape[0],), -100).index_put_((ids,), targets[on_shape, 1].long())
            seen = counts > 0
            loss = loss + F.cross_entropy(self.pooled(pooled[seen] / counts[seen, None]), labels[seen])
        return loss

    def route_loss(self, queries: torch.Tensor, keys: torch.Tensor, layer: int = ROUTE_LAYER) -> torch.Tensor:
        """queries (B, T) bool: positions that predict an answer token; keys (B, T, T) bool: where each should look.
        -> mean over those positions of -log(attention mass of the layer's head 0 on its keys)."""
        attn = self.seen[f"attn{layer}"][:, 0]  # (B, T, T)
        mass = (attn * keys).sum(-1)[queries]  # (Q,)
        return -torch.log(mass.clamp_min(1e-6)).mean() if mass.numel() else attn.sum() * 0

    def read_loss(
        self, queries: torch.Tensor, colours: torch.Tensor, shapes: torch.Tensor, boxes: torch.Tensor
    ) -> torch.Tensor:
        """After the routed layer, where an answer is written about one shape, the hidden state holds that shape's
        colour, kind and box (colours, shapes (B, T) ids, boxes (B, T, 4) in 0..1; queries (B, T) where known)."""
        out = self.answer(self.seen["routed"][queries])  # (Q, 16)
        nc, ns = len(COLOURS), len(SHAPES)
        loss = F.cross_entropy(out[:, :nc], colours[queries]) + F.cross_entropy(out[:, nc : nc + ns], shapes[queries])
        return loss + 10 * F.l1_loss(out[:, nc + ns :], boxes[queries]) if queries.any() else out.sum() * 0

    def picture_loss(self, pictures: torch.Tensor) -> torch.Tensor:
        """pictures (B, T): which picture of its prompt each image token belongs to, -100 elsewhere."""
        keep = pictures >= 0  # (B, T)
        logits = self.picture(self.seen["layer0"][keep])  # (N, 2)
        return F.cross_entropy(logits, pictures[keep])


__all__ = ["Probes", "ROUTE_LAYER", "cell_cover", "shape_cells", "vision_targets"]
