"""Frame decoding: each video opened once and decoded front to back; torchcodec (default) or PyAV. `encode_mp4`
writes frames back into an mp4 (the preview's videos).

Both backends return the same uint8 RGB frames (tested). Every failure is a `DatasetError` naming the file, the
episode and the reason: a missing, unreadable or short video, or a frame whose timestamp is not where the parquet
row says it should be.
"""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path
from typing import Sequence, cast

import numpy as np

from wampipe.preprocess.errors import DatasetError

BACKENDS = ("torchcodec", "pyav")


def decode_video(
    path: str | Path,
    frame_indices: Sequence[int] | np.ndarray,
    *,
    backend: str = "torchcodec",
    episode: int | None = None,
    expected_pts: Sequence[float] | np.ndarray | None = None,
    fps: float | None = None,
    required_frames: int | None = None,
    tolerance_s: float | None = None,
) -> np.ndarray:
    """uint8 [N, H, W, 3] for `frame_indices` (0-based, in presentation order, any order or repeats).

    required_frames: the file must hold at least this many frames (else "short video").
    expected_pts: per requested frame, where its timestamp must be; checked within `tolerance_s`
    (default a quarter frame period, so a frame can never be mistaken for its neighbour).
    """
    path = Path(path)
    if backend not in BACKENDS:
        raise ValueError(f"unknown decode backend {backend!r}; choose one of {BACKENDS}")
    if not path.is_file():
        raise DatasetError(path, episode, "video file is missing")
    indices = np.asarray(frame_indices, dtype=np.int64)
    if indices.size == 0:
        raise ValueError("no frames requested")
    unique = np.unique(indices)  # sorted: one front-to-back pass
    try:
        if backend == "torchcodec":
            frames, pts = _decode_torchcodec(path, unique, required_frames)
        else:
            frames, pts = _decode_pyav(path, unique, fps, required_frames)
    except _Short as short:
        raise DatasetError(path, episode, f"short video: {short}") from None
    except DatasetError:
        raise
    except Exception as err:  # decoders raise RuntimeError, av.error.*, ValueError for damaged input
        raise DatasetError(path, episode, f"cannot decode video ({backend}): {type(err).__name__}: {err}") from err

    if expected_pts is not None:
        expected = np.asarray(expected_pts, dtype=np.float64)
        got = pts[np.searchsorted(unique, indices)]
        tol = tolerance_s if tolerance_s is not None else (0.25 / fps if fps else 1e-3)
        bad = np.flatnonzero(~(np.abs(got - expected) <= tol))  # a NaN expectation is off too
        if bad.size:
            i = bad[0]
            raise DatasetError(
                path,
                episode,
                f"frame {int(indices[i])} has timestamp {got[i]:.4f} s, the parquet row expects {expected[i]:.4f} s "
                f"(tolerance {tol:.4f} s; {bad.size} frames off)",
            )
    return frames[np.searchsorted(unique, indices)]


class _Short(Exception):
    pass


def _decode_torchcodec(path: Path, unique: np.ndarray, required: int | None):
    # torchcodec's public path: the package imports it from a private module without re-exporting it by name
    from torchcodec.decoders import VideoDecoder  # pyright: ignore[reportPrivateImportUsage]

    decoder = VideoDecoder(str(path), dimension_order="NHWC", seek_mode="exact")
    total = decoder.metadata.num_frames
    if total is not None and required is not None and total < required:
        raise _Short(f"{total} frames in the file, the episode needs {required}")
    if total is not None and unique[-1] >= total:
        raise _Short(f"frame {int(unique[-1])} requested, the file has {total} frames")
    batch = decoder.get_frames_at(unique.tolist())
    return batch.data.numpy(), batch.pts_seconds.numpy().astype(np.float64)


def _decode_pyav(path: Path, unique: np.ndarray, fps: float | None, required: int | None):
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        # PyAV types the rates, a frame's pts and the time base Optional. A stream with neither rate, or a frame
        # without pts, fails in the arithmetic below and is reported as a decode error; a demuxed stream always
        # has its time base.
        time_base = cast(Fraction, stream.time_base)
        rate = fps or float(stream.average_rate or stream.guessed_rate)  # pyright: ignore[reportArgumentType]
        total = stream.frames or None
        if total is not None and required is not None and total < required:
            raise _Short(f"{total} frames in the file, the episode needs {required}")
        start = stream.start_time or 0
        first = int(unique[0])
        if first > 0:  # jump to the keyframe before the first wanted frame, then decode forward
            container.seek(start + int(first / rate / time_base), stream=stream, backward=True, any_frame=False)
        wanted = set(unique.tolist())
        frames, pts, last, index = [], [], int(unique[-1]), -1
        for frame in container.decode(stream):
            t = float((frame.pts - start) * time_base)  # pyright: ignore[reportOptionalOperand]
            index = int(round(t * rate))
            if index in wanted:
                frames.append(frame.to_ndarray(format="rgb24"))
                pts.append(float(frame.pts * time_base))  # pyright: ignore[reportOptionalOperand]
                wanted.discard(index)
            if index >= last:
                break
        if wanted:  # the file ended (or skipped frames) before everything we want was seen
            missing = min(wanted)
            raise _Short(f"frame {missing} requested, the video has no frame there (decoded up to frame {index})")
    return np.stack(frames), np.asarray(pts)


def decode_image_cells(
    cells: Sequence[bytes], path: str | Path, episode: int | None, column: str, rows: Sequence[int] | None = None
) -> np.ndarray:
    """PNG/JPEG bytes (LeRobot `dtype: image` parquet cells) -> uint8 [N, H, W, 3]; `rows`: the episode rows of the
    cells, for messages (default 0, 1, ...). Cells of one camera must share one size."""
    from PIL import Image

    out = []
    for i, cell in enumerate(cells):
        row = rows[i] if rows is not None else i
        if not cell:
            raise DatasetError(path, episode, f"column {column!r} row {row}: empty image cell")
        try:
            with Image.open(io.BytesIO(cell)) as img:
                out.append(np.asarray(img.convert("RGB")))
        except Exception as err:  # PIL raises several types for damaged images
            raise DatasetError(path, episode, f"column {column!r} row {row}: cannot decode image: {err}") from err
        if out[-1].shape != out[0].shape:
            first = rows[0] if rows is not None else 0
            (h0, w0), (h, w) = out[0].shape[:2], out[-1].shape[:2]
            raise DatasetError(
                path,
                episode,
                f"column {column!r}: image cells of different sizes: {h0}x{w0} at row {first}, {h}x{w} at row {row}",
            )
    return np.stack(out)


def encode_mp4(path: Path, frames: np.ndarray, fps: int, codec: str) -> None:
    """H.264 as DROID's converter writes it, or AV1 (SVT-AV1, GOP 2) as LeRobot's default encoder does."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as out:
        if codec == "h264":
            stream = out.add_stream("libx264", rate=fps)
            stream.options = {"crf": "23", "preset": "ultrafast", "tune": "zerolatency"}
        else:
            stream = out.add_stream("libsvtav1", rate=fps)
            stream.options = {"crf": "30", "preset": "12", "svtav1-params": "lp=1"}
            stream.codec_context.gop_size = 2
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for img in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        out.mux(stream.encode())
