"""Attention weights as pictures: one tile per (layer, head), rows = queries, columns = keys.

A weight of exactly 0 is white; every positive weight is blue, on a ramp that starts visibly off-white,
so the causal mask shows as an exactly white upper triangle and no allowed key can look masked. A
colour scale under the tiles reads the ramp. Shapes: L layers, H heads, T prompt length.
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

EMPTY, LOW, HIGH = (255, 255, 255), (198, 219, 239), (8, 48, 107)  # weight 0, the smallest > 0, weight 1
INVALID = (220, 0, 0)  # NaN/inf: a bug, drawn so it cannot be missed
GAMMA = 0.5  # sqrt ramp: spread attention (1/T per key) stays visibly different from focused attention
SCALE_TICKS = (0.01, 0.1, 0.5, 1.0)


@dataclass(frozen=True)
class Layout:
    """Pixel geometry of a grid of tiles: one row per layer, one column per head, and the scale below."""

    T: int
    rows: int
    cols: int
    cell: int  # side of one (query, key) cell in pixels
    label: int  # width of the query labels and height of the key labels (0 = no labels)
    title: int = 14  # the "layer l head h" line above each tile
    gap: int = 12
    scale: int = 40  # the colour scale's strip

    def origin(self, row: int, col: int) -> tuple[int, int]:
        """Top-left pixel (x, y) of cell (0, 0) of tile (row, col)."""
        side = self.T * self.cell
        return (self.gap + col * (self.label + side + self.gap) + self.label,
                self.gap + row * (self.title + self.label + side + self.gap) + self.title + self.label)

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the whole picture."""
        x, y = self.origin(self.rows, self.cols)
        return max(x - self.label, 330), y - self.title - self.label + self.scale


def layout_for(n_rows: int, n_cols: int, T: int) -> Layout:
    """The geometry render_attention uses: ~450 px per tile, 14 px cells up to T = 32, 2 px at T >= 224."""
    cell = max(2, min(14, 448 // T))
    return Layout(T=T, rows=n_rows, cols=n_cols, cell=cell, label=max(cell, 16) if cell >= 8 else 0)


def colour(weights: np.ndarray) -> np.ndarray:
    """Weights (..., T, T) in [0, 1] -> RGB uint8 (..., T, T, 3); exactly 0 -> EMPTY, non-finite -> INVALID."""
    w = np.asarray(weights, dtype=np.float64)
    finite = np.isfinite(w)
    ramp = np.clip(np.where(finite, w, 0.0), 0.0, 1.0) ** GAMMA
    rgb = np.array(LOW, dtype=np.float64) + (np.array(HIGH) - np.array(LOW)) * ramp[..., None]
    rgb[w == 0], rgb[~finite] = EMPTY, INVALID
    return np.rint(rgb).astype(np.uint8)


def render_attention(maps: Sequence[Tensor | np.ndarray], chars: Sequence[str],
                     layer_ids: Sequence[int] | None = None) -> np.ndarray:
    """Draw L maps (H, T, T) (maps[l][h, q, k]: how much query q attends to key k) as a grid of heatmaps,
    the T prompt characters along both axes of every tile (a space as ⎵, a newline as \\n), and the
    colour scale below. Returns (height, width, 3) uint8 RGB, geometry as layout_for(L, H, T)."""
    from PIL import Image, ImageDraw, ImageFont

    weights = [m.detach().float().cpu().numpy() if isinstance(m, Tensor) else np.asarray(m) for m in maps]
    if not weights or any(w.shape != weights[0].shape or w.shape[1:] != (len(chars),) * 2 for w in weights):
        raise ValueError(f"render_attention needs L >= 1 maps of one shape (H, T, T) and T characters; got "
                         f"{[w.shape for w in weights]} and {len(chars)} characters")
    H, T, _ = weights[0].shape
    layer_ids = list(range(len(weights))) if layer_ids is None else list(layer_ids)
    lay = layout_for(len(weights), H, T)
    canvas = np.full((lay.size[1], lay.size[0], 3), 255, dtype=np.uint8)
    for row, w in enumerate(weights):
        tiles = np.repeat(np.repeat(colour(w), lay.cell, axis=1), lay.cell, axis=2)  # (H, T*cell, T*cell, 3)
        for h in range(H):
            x, y = lay.origin(row, h)
            canvas[y:y + T * lay.cell, x:x + T * lay.cell] = tiles[h]
    bar_x, bar_y, bar_w = lay.gap + 40, lay.size[1] - lay.scale + 6, 240  # the colour scale
    canvas[bar_y:bar_y + 10, bar_x:bar_x + bar_w] = colour(np.linspace(1e-9, 1, bar_w) ** 2)[None]
    image = Image.fromarray(canvas)
    draw, font = ImageDraw.Draw(image), ImageFont.load_default()
    draw.rectangle((lay.gap, bar_y, lay.gap + 10, bar_y + 9), outline=(170, 170, 170))
    draw.text((lay.gap + 14, bar_y), "0", fill=(0, 0, 0), font=font)
    for tick in SCALE_TICKS:
        tx = bar_x + round(tick ** GAMMA * (bar_w - 1))
        draw.line((tx, bar_y + 10, tx, bar_y + 13), fill=(0, 0, 0))
        _centred(draw, (tx, bar_y + 20), f"{tick:g}", font, (0, 0, 0))
    for row in range(len(weights)):
        for h in range(H):
            x, y = lay.origin(row, h)
            side = T * lay.cell
            draw.rectangle((x - 1, y - 1, x + side, y + side), outline=(170, 170, 170))
            draw.text((x - lay.label, y - lay.label - lay.title), f"layer {layer_ids[row]} head {h}",
                      fill=(0, 0, 0), font=font)
            for i, ch in enumerate(chars if lay.label else ()):
                centre = i * lay.cell + lay.cell / 2
                for cx, cy in ((x + centre, y - lay.label / 2), (x - lay.label / 2, y + centre)):  # key, query
                    if ch == " ":  # ⎵, drawn: the default font has no glyph for it
                        draw.line([(cx - 3, cy - 1), (cx - 3, cy + 2), (cx + 3, cy + 2), (cx + 3, cy - 1)],
                                  fill=(60, 60, 60))
                    else:
                        _centred(draw, (cx, cy), {"\n": "\\n", "\t": "\\t"}.get(ch, ch), font, (60, 60, 60))
    return np.asarray(image)


def _centred(draw, xy: tuple[float, float], text: str, font, fill: tuple[int, int, int]) -> None:
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text((xy[0] - (left + right) / 2, xy[1] - (top + bottom) / 2), text, fill=fill, font=font)


@torch.no_grad()
def attention_maps(model: GPT, idx: Tensor) -> list[Tensor]:
    """Attention weights of every layer for idx (B, T): n_layer tensors (B, H, T, T). Sets each attention
    module's keep_weights flag for one forward (the from-scratch path, on an sdpa model too) and clears
    it again. `model` is the plain module, in the mode the caller chose."""
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
    """Attention weights of every layer for one prompt, in eval mode: L tensors (H, T, T), float32, CPU."""
    if not 1 <= len(ids) <= model.config.block_size:
        raise ValueError(f"an attention prompt needs 1..block_size={model.config.block_size} tokens, got {len(ids)}")
    with evaluating(model):
        maps = attention_maps(model, torch.tensor([list(ids)], device=model.tok_emb.weight.device))
    return [m[0].float().cpu() for m in maps]


def save_attention_png(path: str | Path, maps: Sequence[Tensor | np.ndarray], chars: Sequence[str]) -> Path:
    """render_attention(maps, chars) written to path as a PNG; returns the path."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(render_attention(maps, chars)).save(path, format="PNG")
    return path
