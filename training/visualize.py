"""Attention maps as images: a tile per (layer, head), rows = queries, columns = keys; weight 0 is white (the
causal mask's upper triangle). L layers, H heads, T prompt length."""

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from data import SEPARATOR
from model import GPT

from .evaluate import evaluating

EMPTY, LOW, HIGH = (255, 255, 255), (198, 219, 239), (8, 48, 107)  # weight 0, smallest > 0, 1
INVALID = (220, 0, 0)  # NaN/inf: a bug, made visible
GAMMA = 0.5  # sqrt ramp: spread attention (1/T per key) stays distinct from focused
BLACK, GREY, LINE = (0, 0, 0), (60, 60, 60), (170, 170, 170)  # titles, labels, outlines


@dataclass(frozen=True)
class Layout:
    """Pixel geometry: a row of tiles per layer, a column per head, colour scale below."""

    T: int
    rows: int
    cols: int
    cell: int  # pixels per (query, key) cell
    label: int  # label band (0 = none)
    title: int = 14
    gap: int = 12
    scale: int = 40

    def origin(self, row: int, col: int) -> tuple[int, int]:
        """(x, y) of tile (row, col)'s top-left cell."""
        side = self.T * self.cell
        return (self.gap + col * (self.label + side + self.gap) + self.label,
                self.gap + row * (self.title + self.label + side + self.gap) + self.title + self.label)

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the whole image in pixels."""
        x, y = self.origin(self.rows, self.cols)
        return max(x - self.label, 330), y - self.title - self.label + self.scale


def layout_for(n_rows: int, n_cols: int, T: int) -> Layout:
    """Geometry: 14 px cells up to T = 36 (a T x 14 px tile), then ~512 px tiles of 2..13 px cells; labelled while a
    cell is >= 8 px (T <= 64)."""
    cell = max(2, min(14, 512 // T))
    return Layout(T=T, rows=n_rows, cols=n_cols, cell=cell, label=max(cell, 16) if cell >= 8 else 0)


def colour(weights: np.ndarray) -> np.ndarray:
    """Weights (..., T, T) in [0, 1] -> RGB uint8 (..., T, T, 3); 0 -> EMPTY, non-finite -> INVALID."""
    w = np.asarray(weights, dtype=np.float64)
    ramp = np.clip(w, 0.0, 1.0) ** GAMMA
    rgb = np.add(LOW, np.subtract(HIGH, LOW) * ramp[..., None])
    rgb[w == 0], rgb[~np.isfinite(w)] = EMPTY, INVALID
    return np.rint(rgb).astype(np.uint8)


def render_attention(maps: Sequence[Tensor], chars: Sequence[str],
                     layer_ids: Sequence[int] | None = None) -> np.ndarray:
    """L maps (H, T, T) [h, query, key], labelled with T chars, above a colour scale -> (height, width, 3) uint8."""
    from PIL import Image, ImageDraw, ImageFont

    weights = [m.float().numpy(force=True) for m in maps]
    if not weights or any(w.shape != weights[0].shape or w.shape[1:] != (len(chars),) * 2 for w in weights):
        raise ValueError(f"need L >= 1 maps (H, T, T) for T = {len(chars)} chars, got {[w.shape for w in weights]}")
    lay = layout_for(len(weights), len(weights[0]), len(chars))
    side = lay.T * lay.cell
    image = Image.new("RGB", lay.size, EMPTY)
    draw, font = ImageDraw.Draw(image), ImageFont.load_default()
    for row, w in enumerate(weights):
        for h, tile in enumerate(colour(w)):  # (T, T, 3)
            x, y = lay.origin(row, h)
            image.paste(Image.fromarray(tile).resize((side, side), Image.NEAREST), (x, y))
            draw.rectangle((x - 1, y - 1, x + side, y + side), outline=LINE)
            title = f"layer {row if layer_ids is None else layer_ids[row]} head {h}"
            draw.text((x - lay.label, y - lay.label - lay.title), title, fill=BLACK, font=font)
            for i, ch in enumerate(chars if lay.label else ()):
                centre = i * lay.cell + lay.cell / 2
                for cx, cy in ((x + centre, y - lay.label / 2), (x - lay.label / 2, y + centre)):  # key, query
                    if ch == " ":  # ⎵: the default font lacks it
                        draw.line([(cx - 3, cy - 1), (cx - 3, cy + 2), (cx + 3, cy + 2), (cx + 3, cy - 1)], fill=GREY)
                    else:
                        label = {"\n": "\\n", "\t": "\\t", SEPARATOR: "RS"}.get(ch, ch)  # RS: ASCII's name for it
                        draw.text((cx, cy), label, fill=GREY, font=font, anchor="mm")
    x, y, width = lay.gap + 40, lay.size[1] - lay.scale + 6, 240  # scale: swatch for 0, then ramp
    ramp = colour(np.linspace(1e-9, 1, width) ** (1 / GAMMA))[None]  # (1, width, 3): even in colour
    image.paste(Image.fromarray(ramp).resize((width, 10), Image.NEAREST), (x, y))
    draw.rectangle((lay.gap, y, lay.gap + 10, y + 9), outline=LINE)
    draw.text((lay.gap + 14, y), "0", fill=BLACK, font=font)
    for tick in (0.01, 0.1, 0.5, 1.0):
        tx = x + round(tick ** GAMMA * (width - 1))
        draw.line((tx, y + 10, tx, y + 13), fill=BLACK)
        draw.text((tx, y + 20), f"{tick:g}", fill=BLACK, font=font, anchor="mm")
    return np.asarray(image)


@torch.no_grad()
def prompt_attention(model: GPT, ids: Sequence[int]) -> list[Tensor]:
    """Each layer's attention for one prompt, in eval mode: L float32 CPU tensors (H, T, T), asked of each layer
    with the inputs the forward gives it (a pre-hook), whatever its backend."""
    maps: list[Tensor] = []
    ask = lambda attn, args: maps.append(attn.weights(*args[:3])[0].float().cpu())  # args: x, mask, rope, cache
    with contextlib.ExitStack() as hooks, evaluating(model):  # the hooks come off again, even on an error
        for block in model.blocks:
            hooks.enter_context(block.attn.register_forward_pre_hook(ask))
        model(torch.tensor([list(ids)], device=model.tok_emb.weight.device))
    return maps
