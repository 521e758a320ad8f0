"""Per-view transform, canvas layouts (pixel by pixel), color jitter math, augmentation determinism, model resize."""

import colorsys
import json

import numpy as np
import pytest
import torch
from PIL import Image

from wampipe.preprocess.lerobot import LeRobotDataset
from wampipe.preprocess.views import (
    adjust_brightness,
    adjust_contrast,
    adjust_hue,
    adjust_saturation,
    draw_train_params,
    episode_canvas,
    episode_model_video,
    eval_params,
    make_canvas,
    sample_video,
    to_model_video,
    transform_views,
)
from wampipe.preprocess.windows import episode_windows
from wampipe.shardformat.embodiments import get_embodiment


def distinct_views(v: int, t: int, h: int, w: int) -> np.ndarray:
    rng = np.random.default_rng(v * 1000 + t)
    return rng.integers(0, 256, size=(v, t, h, w, 3), dtype=np.uint8)


def test_eval_crop_boxes():
    assert eval_params(180, 320) == {"crop": [4, 8, 171, 304], "jitter": None}  # DROID crop 171x304; round(4.5) = 4
    assert eval_params(256, 256)["crop"] == [6, 6, 243, 243]


def test_droid_canvas_pixel_by_pixel():
    views = distinct_views(3, 2, 5, 7)  # ext_1, ext_2, wrist
    canvas = make_canvas(views, "droid_2x2")
    assert canvas.shape == (2, 10, 14, 3)
    for t in range(2):
        for y in range(5):
            for x in range(7):
                assert (canvas[t, y, 2 * x] == views[2, t, y, x]).all() and (
                    canvas[t, y, 2 * x + 1] == views[2, t, y, x]
                ).all()
                assert (canvas[t, 5 + y, x] == views[0, t, y, x]).all()
                assert (canvas[t, 5 + y, 7 + x] == views[1, t, y, x]).all()


def test_side_by_side_canvas_pixel_by_pixel():
    views = distinct_views(2, 3, 4, 4)  # image, wrist_image
    canvas = make_canvas(views, "side_by_side")
    assert canvas.shape == (3, 4, 8, 3)
    assert (canvas[:, :, :4] == views[0]).all() and (canvas[:, :, 4:] == views[1]).all()
    with pytest.raises(ValueError):
        make_canvas(views, "droid_2x2")


def test_resize_matches_pil_antialiased_bilinear():
    """The per-view resize is torchvision's bilinear antialiased resize; PIL's is the same filter (within rounding)."""
    views = distinct_views(1, 1, 60, 90)
    out = transform_views(views, (32, 48), {"crop": [0, 0, 60, 90], "jitter": None})[0, 0]
    pil = np.asarray(Image.fromarray(views[0, 0]).resize((48, 32), Image.Resampling.BILINEAR), dtype=np.int16)
    assert np.abs(out.astype(np.int16) - pil).max() <= 2


def test_truncation_not_rounding():
    """uint8 via (x * 255).to(uint8): a 0.999-level value is truncated down."""
    views = np.full((1, 1, 4, 4, 3), 100, np.uint8)
    params = {
        "crop": [0, 0, 4, 4],
        "jitter": {"order": ["brightness"], "brightness": 1.009, "contrast": 1.0, "saturation": 1.0, "hue": 0.0},
    }
    assert transform_views(views, (4, 4), params).max() == 100  # 100.9 -> 100 (rounding would give 101)


def test_color_ops_against_direct_formulas():
    rng = torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, 5, 6, generator=rng)
    gray = 0.2989 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]
    torch.testing.assert_close(adjust_brightness(x, 1.2), (x * 1.2).clamp(0, 1))
    torch.testing.assert_close(adjust_saturation(x, 0.0), gray[:, None].expand_as(x))
    mean = gray.mean(dim=(1, 2))[:, None, None, None]  # one mean per image
    torch.testing.assert_close(adjust_contrast(x, 0.7), (0.7 * x + 0.3 * mean).clamp(0, 1))
    hue = adjust_hue(x, 0.08)
    for n, y, col in [(0, 0, 0), (1, 4, 5), (0, 2, 3)]:
        h, s, v = colorsys.rgb_to_hsv(*x[n, :, y, col].tolist())
        expected = colorsys.hsv_to_rgb((h + 0.08) % 1.0, s, v)
        np.testing.assert_allclose(hue[n, :, y, col].numpy(), expected, atol=1e-5)
    grey = torch.full((1, 3, 2, 2), 0.4)
    torch.testing.assert_close(adjust_hue(grey, 0.05), grey)


def test_train_params_reference_draw_order_and_ranges():
    """Same draws as the reference's RandomCrop then ColorJitter on torch's default generator with the same seed."""
    params = draw_train_params(180, 320, torch.Generator().manual_seed(7))
    torch.manual_seed(7)
    top, left = int(torch.randint(0, 10, size=())), int(torch.randint(0, 17, size=()))
    order = torch.randperm(4).tolist()
    factors = [torch.empty(1).uniform_(a, b).item() for a, b in ((0.7, 1.3), (0.6, 1.4), (0.5, 1.5), (-0.08, 0.08))]
    assert params["crop"] == [top, left, 171, 304]
    names = ["brightness", "contrast", "saturation", "hue"]
    assert params["jitter"]["order"] == [names[i] for i in order]
    assert [params["jitter"][n] for n in names] == pytest.approx(factors)
    assert json.loads(json.dumps(params)) == params


def test_augmentation_determinism_and_replay():
    emb = get_embodiment("libero_sim")
    views = list(distinct_views(2, 3, 64, 64))
    a = sample_video(views, emb, "5b", generator=torch.Generator().manual_seed(3))
    b = sample_video(views, emb, "5b", generator=torch.Generator().manual_seed(3))
    c = sample_video(views, emb, "5b", generator=torch.Generator().manual_seed(4))
    assert a[2] == b[2] and a[2] != c[2]
    assert torch.equal(a[0], b[0]) and (a[1] == b[1]).all() and not (a[1] == c[1]).all()
    replay = sample_video(views, emb, "5b", params=json.loads(json.dumps(a[2])))
    assert (replay[1] == a[1]).all()


def test_one_draw_shared_by_all_views_and_frames():
    emb = get_embodiment("oxe_droid")
    frame = distinct_views(1, 1, 180, 320)[0, 0]
    views = [np.stack([frame] * 4)] * 3  # every view and frame identical
    _, canvas, params = sample_video(views, emb, "14b", generator=torch.Generator().manual_seed(11))
    assert params["jitter"] is not None
    bottom_left, bottom_right, top = canvas[:, 176:, :320], canvas[:, 176:, 320:], canvas[:, :176, ::2]
    assert (bottom_left == bottom_right).all() and (top == bottom_left).all()
    assert (canvas == canvas[:1]).all()


def test_model_video_range_and_resize():
    canvas = np.zeros((2, 256, 512, 3), np.uint8)
    canvas[..., 1] = 255
    video = to_model_video(canvas, (160, 320))
    assert video.shape == (3, 2, 160, 320) and video.dtype == torch.float32
    assert video[0].eq(-1).all() and video[1].eq(1).all()
    same = to_model_video(canvas, (256, 512))
    assert same.shape == (3, 2, 256, 512)
    expected = torch.nn.functional.interpolate(
        same.permute(1, 0, 2, 3), size=(160, 320), mode="bilinear", align_corners=False
    ).permute(1, 0, 2, 3)
    torch.testing.assert_close(video, expected)


@pytest.mark.parametrize(
    "preset,canvas_hw,model_hw",
    [("14b", (352, 640), (352, 640)), ("5b", (352, 640), (176, 320)), ("5b-wan22", (320, 640), (160, 320))],
)
def test_droid_window_on_sample_dataset(droid_root, preset, canvas_hw, model_hw):
    emb = get_embodiment("oxe_droid")
    ds = LeRobotDataset(droid_root)
    episode = ds.episode(ds.episode_indices[0])
    rows = list(range(0, 97, 3))
    views = [episode.cameras[c].read(rows) for c in emb.cameras]
    video, canvas, params = sample_video(views, emb, preset)
    assert canvas.shape == (33, *canvas_hw, 3) and canvas.dtype == np.uint8
    assert video.shape == (3, 33, *model_hw) and -1 <= video.min() and video.max() <= 1
    assert params == eval_params(180, 320)
    h, w = emb.view_size(preset)
    wrist = transform_views(np.stack(views)[2:], (h, w), params)[0]
    assert (canvas[:, :h, 0::2] == wrist).all() and (canvas[:, :h, 1::2] == wrist).all()


@pytest.mark.parametrize("preset", ["5b", "14b"])
def test_episode_canvas_equals_per_window_transform(droid_root, preset):
    """The shard builder transforms each frame once per episode; a window's video must equal the per-window path."""
    emb = get_embodiment("oxe_droid")
    episode = LeRobotDataset(droid_root).episode(3)
    frames = np.stack([episode.cameras[c].read() for c in emb.cameras])  # [V, L, H, W, 3]
    canvas = episode_canvas(frames, emb, preset, eval_params(*frames.shape[2:4]), chunk=40)
    windows = episode_windows(episode.length, emb.window)
    for window in (windows[0], windows[len(windows) // 2], windows[-1]):
        video, window_canvas, _ = sample_video(list(frames[:, window.video_rows]), emb, preset)
        np.testing.assert_array_equal(canvas[window.video_rows], window_canvas)
        assert torch.equal(to_model_video(canvas[window.video_rows], emb.preset(preset).target_hw), video)
    whole = episode_model_video(canvas, emb.preset(preset).target_hw, chunk=40)
    for window in windows[:: max(1, len(windows) // 4)]:
        video, _, _ = sample_video(list(frames[:, window.video_rows]), emb, preset)
        assert torch.equal(whole[:, window.video_rows], video)
