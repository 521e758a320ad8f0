"""Compare preprocess/views.py with torchvision.transforms.v2 where torchvision imports (e.g. the GPU image).

torchvision cannot be installed beside the CPU torch of the development machines, so the view transforms are
written with torch ops; this script is the cross-check against the library the reference uses. It runs the same
crop, antialiased resize and each ColorJitter op (and a full jitter in a drawn order) through both and prints the
largest difference per op as one JSON line; exit 1 if any op differs by more than --tolerance.

    python scripts/check_views_torchvision.py
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from wampipe.configs.cli import cli
from wampipe.errors import entry_point
from wampipe.preprocess import views


@dataclass
class Args:
    tolerance: float = 1e-5
    """Largest allowed difference, in [0, 1] pixel units."""


def main(argv: list[str] | None = None) -> None:
    args = cli(Args, args=argv, description=__doc__)
    # torchvision is this comparison's optional dependency: not installed beside the CPU torch of development machines
    import torchvision  # pyright: ignore[reportMissingImports]
    from torchvision.transforms import InterpolationMode  # pyright: ignore[reportMissingImports]
    from torchvision.transforms.v2 import functional as TF  # pyright: ignore[reportMissingImports]

    gen = torch.Generator().manual_seed(0)
    x = torch.rand(6, 3, 180, 320, generator=gen)
    diffs = {}
    for factor in (0.7, 1.3):
        diffs[f"brightness_{factor}"] = (
            (views.adjust_brightness(x, factor) - TF.adjust_brightness(x, factor)).abs().max()
        )
        diffs[f"contrast_{factor}"] = (views.adjust_contrast(x, factor) - TF.adjust_contrast(x, factor)).abs().max()
        diffs[f"saturation_{factor}"] = (
            (views.adjust_saturation(x, factor) - TF.adjust_saturation(x, factor)).abs().max()
        )
    for factor in (-0.08, 0.05):
        diffs[f"hue_{factor}"] = (views.adjust_hue(x, factor) - TF.adjust_hue(x, factor)).abs().max()
    params = views.draw_train_params(180, 320, gen)
    ours = views.color_jitter(x, params["jitter"])
    theirs = x
    for name in params["jitter"]["order"]:
        theirs = getattr(TF, f"adjust_{name}")(theirs, params["jitter"][name])
    diffs["jitter_drawn"] = (ours - theirs).abs().max()
    top, left, ch, cw = params["crop"]
    crop_ours = torch.nn.functional.interpolate(
        x[:, :, top : top + ch, left : left + cw], size=(176, 320), mode="bilinear", align_corners=False, antialias=True
    )
    crop_theirs = TF.resize(TF.crop(x, top, left, ch, cw), [176, 320], InterpolationMode.BILINEAR, antialias=True)
    diffs["crop_resize"] = (crop_ours - crop_theirs).abs().max()
    center = views.eval_params(180, 320)["crop"]
    tv_center = TF.center_crop(torch.arange(180 * 320.0).reshape(1, 180, 320), [center[2], center[3]])
    diffs["center_crop_offset"] = torch.tensor(float(tv_center[0, 0, 0] != center[0] * 320 + center[1]))
    result = {k: float(v) for k, v in diffs.items()}
    ok = all(v <= args.tolerance for v in result.values())
    print(
        json.dumps(
            {"check": "views_vs_torchvision", "torchvision": torchvision.__version__, "ok": ok, "max_abs_diff": result}
        )
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main()
