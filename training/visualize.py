"""Attention weights as pictures: one tile per (layer, head), rows = queries, columns = keys.

Cells are coloured with numpy; Pillow (installed with tensorboard) draws the characters on the axes
and is imported only when a picture is drawn. A weight that is exactly 0 is drawn EMPTY (white);
every positive weight is drawn on a blue ramp that starts visibly off-white. So the causal mask shows
as an exactly white upper triangle, and no allowed key can look masked however small its weight.

Shapes: L layers, H heads, T prompt length (queries = keys = T).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from model import GPT

from .evaluate import evaluating

EMPTY = (255, 255, 255)  # weight exactly 0: a masked (or fully ignored) key
LOW = (198, 219, 239)  # the smallest positive weight
HIGH = (8, 48, 107)  # weight 1
INVALID = (220, 0, 0)  # NaN/inf: a bug, drawn so it cannot be missed
GAMMA = 0.5  # sqrt ramp: spread attention (1/T per key) stays visibly different from focused attention
LABEL_CHARS = {"\n": "\\n", "\t": "\\t", " ": "·"}  # Pillow's default font has no ¶ or ⏎


@dataclass(frozen=True)
class Layout:
    """Pixel geometry of a grid of attention tiles: one row per layer, one column per head."""

    T: int
    rows: int
    cols: int
    cell: int  # side of one (query, key) cell in pixels
    label: int  # width of the query-label column and height of the key-label row (0 = no labels)
    title: int = 14  # height of the "layer l head h" line above each tile
    gap: int = 12  # space between tiles and around the grid

    @property
    def tile_w(self) -> int:
        """Width of one head's tile in pixels: query labels, then T cells."""
        return self.label + self.T * self.cell

    @property
    def tile_h(self) -> int:
        """Height of one head's tile in pixels: title, key labels, then T cells."""
        return self.title + self.label + self.T * self.cell

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the whole picture."""
        return (self.gap + self.cols * (self.tile_w + self.gap), self.gap + self.rows * (self.tile_h + self.gap))

    def origin(self, row: int, col: int) -> tuple[int, int]:
        """Top-left pixel (x, y) of the heatmap (cell (0, 0)) of tile (row, col)."""
        x = self.gap + col * (self.tile_w + self.gap) + self.label
        y = self.gap + row * (self.tile_h + self.gap) + self.title + self.label
        return x, y

    def cell_box(self, row: int, col: int, query: int, key: int) -> tuple[int, int, int, int]:
        """(x0, y0, x1, y1), exclusive, of the cell for `query` (a row) and `key` (a column)."""
        x, y = self.origin(row, col)
        x0, y0 = x + key * self.cell, y + query * self.cell
        return x0, y0, x0 + self.cell, y0 + self.cell


def layout_for(n_rows: int, n_cols: int, T: int) -> Layout:
    """The geometry render_attention uses for n_rows x n_cols tiles of T x T cells."""
    cell = max(2, min(14, 448 // T))  # ~450 px per tile: 14 px cells up to T = 32, 2 px at T = 224+
    return Layout(T=T, rows=n_rows, cols=n_cols, cell=cell, label=max(cell, 16) if cell >= 8 else 0)


def label_char(ch: str) -> str:
    """How a character is written on the axes: newline, tab and space made visible."""
    return LABEL_CHARS.get(ch, ch)


def colour(weights: np.ndarray) -> np.ndarray:
    """Weights (..., T, T) in [0, 1] -> RGB uint8 (..., T, T, 3); exactly 0 -> EMPTY."""
    w = np.asarray(weights, dtype=np.float64)
    finite = np.isfinite(w)
    ramp = np.clip(np.where(finite, w, 0.0), 0.0, 1.0) ** GAMMA
    low, high = np.array(LOW, dtype=np.float64), np.array(HIGH, dtype=np.float64)
    rgb = low + (high - low) * ramp[..., None]
    rgb[w == 0] = EMPTY
    rgb[~finite] = INVALID
    return np.rint(rgb).astype(np.uint8)


def render_attention(maps: Sequence[Tensor | np.ndarray], chars: Sequence[str],
                     layer_ids: Sequence[int] | None = None) -> np.ndarray:
    """Draw attention weights as a grid of heatmaps: one row per layer, one tile per head.

    Args:
        maps: L tensors (H, T, T); maps[l][h, q, k] is how much query q attends to key k.
        chars: the T characters of the prompt, written along both axes of every tile.
        layer_ids: the layer numbers for the tile titles (default 0..L-1).
    Returns:
        (height, width, 3) uint8 RGB image; geometry as layout_for(L, H, T) describes.
    """
    from PIL import Image, ImageDraw, ImageFont

    if not maps:
        raise ValueError("render_attention needs at least one layer of attention weights")
    weights = [m.detach().float().cpu().numpy() if isinstance(m, Tensor) else np.asarray(m) for m in maps]
    H, T, Tk = weights[0].shape
    if T != Tk or any(w.shape != (H, T, T) for w in weights) or len(chars) != T:
        raise ValueError(f"render_attention needs L maps of one shape (H, T, T) and T characters; got shapes "
                         f"{[w.shape for w in weights]} and {len(chars)} characters")
    layer_ids = list(range(len(weights))) if layer_ids is None else list(layer_ids)
    layout = layout_for(len(weights), H, T)
    canvas = np.full((layout.size[1], layout.size[0], 3), 255, dtype=np.uint8)
    for row, w in enumerate(weights):
        tiles = np.repeat(np.repeat(colour(w), layout.cell, axis=1), layout.cell, axis=2)  # (H, Tc, Tc, 3)
        for h in range(H):
            x, y = layout.origin(row, h)
            canvas[y:y + T * layout.cell, x:x + T * layout.cell] = tiles[h]
    image = Image.fromarray(canvas)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    for row in range(len(weights)):
        for h in range(H):
            x, y = layout.origin(row, h)
            side = T * layout.cell
            draw.rectangle((x - 1, y - 1, x + side, y + side), outline=(170, 170, 170))  # outside the cells
            draw.text((x - layout.label, y - layout.label - layout.title), f"layer {layer_ids[row]} head {h}",
                      fill=(0, 0, 0), font=font)
            if not layout.label:
                continue  # cells too small for characters
            for i, ch in enumerate(chars):
                centre = i * layout.cell + layout.cell / 2
                text = label_char(ch)
                _centred(draw, (x + centre, y - layout.label / 2), text, font)  # key, above its column
                _centred(draw, (x - layout.label / 2, y + centre), text, font)  # query, left of its row
    return np.asarray(image)


def _centred(draw, xy: tuple[float, float], text: str, font) -> None:
    """Draw text centred on xy (works with the bitmap font too, which has no anchors)."""
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text((xy[0] - (left + right) / 2, xy[1] - (top + bottom) / 2), text, fill=(60, 60, 60), font=font)


@torch.no_grad()
def attention_maps(model: GPT, idx: Tensor) -> list[Tensor]:
    """Attention weights of every layer for idx (B, T): n_layer tensors (B, H, T, T).

    Sets each attention module's keep_weights flag for one forward (which runs the from-scratch
    attention, on an sdpa model too) and clears it again. `model` must be the plain module, not a
    torch.compile wrapper; its mode (train or eval) is the caller's.
    """
    layers = [block.attn for block in model.blocks]
    for attn in layers:
        attn.keep_weights = True
    try:
        model(idx)
        return [attn.weights for attn in layers]
    finally:
        for attn in layers:
            attn.keep_weights, attn.weights = False, None


def prompt_attention(model: GPT, ids: Sequence[int]) -> list[Tensor]:
    """Attention weights of every layer for one prompt: L tensors (H, T, T), float32, on the CPU.

    Runs model in eval mode (no dropout, so no random numbers are drawn) and restores its mode.
    """
    if not 1 <= len(ids) <= model.config.block_size:
        raise ValueError(f"an attention prompt needs 1..block_size={model.config.block_size} tokens, "
                         f"got {len(ids)}")
    device = next(model.parameters()).device
    with evaluating(model):
        maps = attention_maps(model, torch.tensor([list(ids)], dtype=torch.long, device=device))
    return [m[0].float().cpu() for m in maps]  # batch item 0: (H, T, T) per layer


def save_attention_png(path: str | Path, maps: Sequence[Tensor | np.ndarray], chars: Sequence[str]) -> Path:
    """render_attention(maps, chars) written to path as a PNG; returns the path."""
    from PIL import Image

    path = Path(path)
    if path.parent != Path():
        path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(render_attention(maps, chars)).save(path, format="PNG")
    return path
