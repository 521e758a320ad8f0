"""Camera views -> one canvas -> model-resolution video in [-1, 1], with torch ops only
(docs/REFERENCE.md#3-views-canvas-and-resize).

Data side, per sample, exactly as the reference's torchvision v2 chain run on all views x frames at once:
crop 95 % (center for eval, random for train: one offset shared by every view and frame) -> bilinear
antialiased resize to the per-view size -> (train) ColorJitter(b .3, c .4, s .5, h .08) with one parameter
draw, ops in random order -> `(x * 255).to(uint8)` (truncation) -> canvas. Model side: `/255`, `(x - .5) / .5`,
bilinear resize (align_corners=False, no antialias) of the whole canvas to the preset's target size.

The augmentation parameters are drawn from a `torch.Generator` in the reference's order (crop top, crop left,
op permutation, brightness, contrast, saturation, hue) and returned as a JSON-able dict so a sample can be
recorded and replayed with `apply_params`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from wampipe.shardformat.embodiments import CanvasLayout, Embodiment

CROP_SCALE = 0.95
BRIGHTNESS, CONTRAST, SATURATION, HUE = (0.7, 1.3), (0.6, 1.4), (0.5, 1.5), (-0.08, 0.08)
GRAY_WEIGHTS = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale
JITTER_OPS = ("brightness", "contrast", "saturation", "hue")  # index order of torchvision's fn_idx


# ---------------------------------------------------------------- parameters


def crop_size(height: int, width: int, scale: float = CROP_SCALE) -> tuple[int, int]:
    return int(height * scale), int(width * scale)


def eval_params(height: int, width: int) -> dict:
    """Center crop (torchvision: offsets rounded half to even), no jitter."""
    ch, cw = crop_size(height, width)
    return {"crop": [int(round((height - ch) / 2.0)), int(round((width - cw) / 2.0)), ch, cw], "jitter": None}


def draw_train_params(height: int, width: int, generator: torch.Generator) -> dict:
    """One draw per sample: random crop offset, then the jitter op order and factors."""
    ch, cw = crop_size(height, width)
    top = int(torch.randint(0, height - ch + 1, size=(), generator=generator)) if height > ch else 0
    left = int(torch.randint(0, width - cw + 1, size=(), generator=generator)) if width > cw else 0
    order = [JITTER_OPS[i] for i in torch.randperm(4, generator=generator).tolist()]
    factors = {
        name: float(torch.empty(1).uniform_(lo, hi, generator=generator).item())
        for name, (lo, hi) in zip(JITTER_OPS, (BRIGHTNESS, CONTRAST, SATURATION, HUE))
    }
    return {"crop": [top, left, ch, cw], "jitter": {"order": order, **factors}}


# ---------------------------------------------------------------- color ops on float [N, 3, H, W] in [0, 1]


def _gray(x: torch.Tensor) -> torch.Tensor:
    r, g, b = x.unbind(dim=-3)
    return (GRAY_WEIGHTS[0] * r + GRAY_WEIGHTS[1] * g + GRAY_WEIGHTS[2] * b).unsqueeze(-3)


def _blend(x: torch.Tensor, other: torch.Tensor, ratio: float) -> torch.Tensor:
    return (ratio * x + (1.0 - ratio) * other).clamp(0.0, 1.0)


def adjust_brightness(x: torch.Tensor, factor: float) -> torch.Tensor:
    return (x * factor).clamp(0.0, 1.0)


def adjust_contrast(x: torch.Tensor, factor: float) -> torch.Tensor:
    mean = _gray(x).mean(dim=(-3, -2, -1), keepdim=True)  # one mean per image (per view and frame)
    return _blend(x, mean, factor)


def adjust_saturation(x: torch.Tensor, factor: float) -> torch.Tensor:
    return _blend(x, _gray(x), factor)


def rgb_to_hsv(x: torch.Tensor) -> torch.Tensor:
    r, g, b = x.unbind(dim=-3)
    minc, maxc = torch.aminmax(x, dim=-3)
    flat = maxc == minc  # grey pixels: hue and saturation are 0 (guards both divisions)
    span = maxc - minc
    sat = span / torch.where(flat, torch.ones_like(maxc), maxc)
    span_safe = torch.where(flat, torch.ones_like(span), span)
    rc, gc, bc = (maxc - r) / span_safe, (maxc - g) / span_safe, (maxc - b) / span_safe
    max_is_r = maxc == r
    max_is_g = (maxc == g) & ~max_is_r
    max_is_b = ~max_is_r & ~(maxc == g)
    hue = (bc - gc) * max_is_r + (2.0 + rc - bc) * max_is_g + (4.0 + gc - rc) * max_is_b
    hue = torch.fmod(hue * (1.0 / 6.0) + 1.0, 1.0)
    return torch.stack((hue, sat, maxc), dim=-3)


def hsv_to_rgb(x: torch.Tensor) -> torch.Tensor:
    h, s, v = x.unbind(dim=-3)
    h6 = h * 6.0
    sector = torch.floor(h6)
    frac = h6 - sector
    sector = sector.to(torch.int64).remainder(6)
    p = ((1.0 - s) * v).clamp(0.0, 1.0)
    q = ((1.0 - s * frac) * v).clamp(0.0, 1.0)
    t = ((1.0 - s + s * frac) * v).clamp(0.0, 1.0)
    candidates = torch.stack((v, p, q, t), dim=-3)  # per hue sector, which of (v, p, q, t) each channel takes:
    table = torch.tensor([[0, 2, 1, 1, 3, 0], [3, 0, 0, 2, 1, 1], [1, 1, 3, 0, 0, 2]], device=x.device)
    pick = table[:, sector].movedim(0, -3)  # [..., 3, H, W]
    return candidates.gather(-3, pick)


def adjust_hue(x: torch.Tensor, factor: float) -> torch.Tensor:
    hsv = rgb_to_hsv(x)
    h, s, v = hsv.unbind(dim=-3)
    return hsv_to_rgb(torch.stack((torch.remainder(h + factor, 1.0), s, v), dim=-3))


_ADJUST = {
    "brightness": adjust_brightness,
    "contrast": adjust_contrast,
    "saturation": adjust_saturation,
    "hue": adjust_hue,
}


def color_jitter(x: torch.Tensor, jitter: dict) -> torch.Tensor:
    for name in jitter["order"]:
        x = _ADJUST[name](x, jitter[name])
    return x


# ---------------------------------------------------------------- per-view transform and canvas


def transform_views(views_vthwc: np.ndarray, view_hw: tuple[int, int], params: dict) -> np.ndarray:
    """uint8 [V, T, H, W, 3] -> uint8 [V, T, h, w, 3]: crop, antialiased bilinear resize, jitter, truncation."""
    v, t, height, width, _ = views_vthwc.shape
    top, left, ch, cw = params["crop"]
    if top + ch > height or left + cw > width:
        raise ValueError(f"crop {params['crop']} does not fit views of {height}x{width}")
    x = torch.from_numpy(np.ascontiguousarray(views_vthwc)).reshape(v * t, height, width, 3)
    x = x.permute(0, 3, 1, 2).to(torch.float32) / 255.0  # [V*T, 3, H, W]
    x = x[:, :, top : top + ch, left : left + cw]
    x = F.interpolate(x, size=view_hw, mode="bilinear", align_corners=False, antialias=True)
    if params.get("jitter"):
        x = color_jitter(x, params["jitter"])
    x = (x.permute(0, 2, 3, 1) * 255).to(torch.uint8)  # truncation, as the reference's VideoToNumpy
    return x.reshape(v, t, *view_hw, 3).numpy()


def make_canvas(views_vthwc: np.ndarray, layout: CanvasLayout) -> np.ndarray:
    """uint8 [V, T, h, w, 3] (views in the embodiment's camera order) -> uint8 [T, H', W', 3]."""
    if layout == "droid_2x2":  # views: ext_1, ext_2, wrist
        if views_vthwc.shape[0] != 3:
            raise ValueError(f"droid_2x2 needs 3 views, got {views_vthwc.shape[0]}")
        top = np.repeat(views_vthwc[2], 2, axis=2)  # the wrist view, each pixel repeated twice in width
        bottom = np.concatenate([views_vthwc[0], views_vthwc[1]], axis=2)
        return np.concatenate([top, bottom], axis=1)
    if layout == "side_by_side":
        return np.concatenate(list(views_vthwc), axis=2)
    raise ValueError(f"unknown canvas layout {layout!r}")


def to_model_video(canvas_thwc: np.ndarray, target_hw: tuple[int, int]) -> torch.Tensor:
    """uint8 [T, H, W, 3] -> float32 [3, T, h, w] in [-1, 1] at the model resolution (the VAE's input)."""
    x = torch.from_numpy(np.ascontiguousarray(canvas_thwc)).permute(0, 3, 1, 2).to(torch.float32)
    x.div_(255.0).sub_(0.5).div_(0.5)  # the reference's /255 then Normalize(0.5, 0.5), in place
    if tuple(x.shape[-2:]) != tuple(target_hw):
        x = F.interpolate(x, size=tuple(target_hw), mode="bilinear", align_corners=False, antialias=False)
    return x.permute(1, 0, 2, 3).contiguous()


def episode_canvas(
    frames_vthwc: np.ndarray, embodiment: Embodiment, preset: str, params: dict, chunk: int = 64
) -> np.ndarray:
    """uint8 canvas [T, H', W', 3] of every frame of an episode under one fixed transform (the eval transform).

    Every op up to the canvas works frame by frame, so a window's canvas is this array indexed by its rows: the
    offline builder transforms each frame once instead of once per window (DROID: every row is in ~32 windows).
    Frames are processed `chunk` at a time to bound the float32 temporaries.
    """
    view_hw = embodiment.view_size(preset)
    parts = [
        make_canvas(transform_views(frames_vthwc[:, i : i + chunk], view_hw, params), embodiment.layout)
        for i in range(0, frames_vthwc.shape[1], chunk)
    ]
    return np.concatenate(parts)


def episode_model_video(canvas_thwc: np.ndarray, target_hw: tuple[int, int], chunk: int = 64) -> torch.Tensor:
    """`to_model_video` of a whole episode's canvas, `chunk` frames at a time: float32 [3, T, h, w]. Per frame, so a
    window's model input is this tensor indexed by its rows (the offline builder's eval path)."""
    return torch.cat(
        [to_model_video(canvas_thwc[i : i + chunk], target_hw) for i in range(0, len(canvas_thwc), chunk)], dim=1
    )


def sample_video(
    views: Sequence[np.ndarray],
    embodiment: Embodiment,
    preset: str,
    generator: torch.Generator | None = None,
    params: dict | None = None,
) -> tuple[torch.Tensor, np.ndarray, dict]:
    """Frames of one window, one uint8 [T, H, W, 3] array per camera in `embodiment.cameras` order.

    Eval transform by default; with `generator` a train augmentation is drawn; with `params` a recorded one is
    replayed. Returns (model video float32 [3, T, h, w] in [-1, 1], uint8 canvas [T, H', W', 3], params).
    """
    if len(views) != len(embodiment.cameras):
        raise ValueError(f"{embodiment.tag} needs {len(embodiment.cameras)} views, got {len(views)}")
    shapes = {v.shape for v in views}
    if len(shapes) != 1:
        raise ValueError(f"all views must have one shape (the reference crops them as one batch), got {shapes}")
    stacked = np.stack(views)  # [V, T, H, W, 3]
    height, width = stacked.shape[2:4]
    if params is None:
        params = draw_train_params(height, width, generator) if generator is not None else eval_params(height, width)
    canvas = make_canvas(transform_views(stacked, embodiment.view_size(preset), params), embodiment.layout)
    return to_model_video(canvas, embodiment.preset(preset).target_hw), canvas, params
