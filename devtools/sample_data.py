"""A small but genuine LeRobot dataset: the on-disk layouts of DROID (v2.1; converted by DreamZero, or raw with what
its filters act on), LIBERO (v2.0) and LIBERO (v3.0).

The cameras film a scene that moves with the robot: a gripper marker sits where the simulated end effector is
(each camera projects it differently), grows and shrinks with the gripper, and actions are the next state's
targets, so a model can learn from the data. Deterministic for a seed. Episode lengths vary and always include
one episode shorter than a full training window. CLI: scripts/make_sample_dataset.py.
"""

from __future__ import annotations

import io
import json
import shutil
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from wampipe.preprocess.decode import encode_mp4

DROID_CAMERAS = ("exterior_image_1_left", "exterior_image_2_left", "wrist_image_left")
LIBERO_CAMERAS = ("image", "wrist_image")
DROID_TASKS = [
    "put the marker in the cup",
    "open the top drawer",
    "move the bowl to the left",
    "pick up the red block and place it on the plate",
    "wipe the table with the towel",
    "close the laptop lid",
]
LIBERO_TASKS = [
    "put the black bowl on the plate",
    "open the middle drawer of the cabinet",
    "turn on the stove",
    "put the cream cheese in the bowl",
]
# Full window extents: episodes shorter than this yield no full window
# (docs/REFERENCE.md#2-windows-and-anchor-sampling).
WINDOW_EXTENT = {"droid": 97, "libero": 73, "libero-v3": 73}


@dataclass
class Trajectory:
    eef_xyz: np.ndarray  # [L+1, 3] in [-1, 1]
    eef_rot: np.ndarray  # [L+1, 3] axis-angle
    gripper: np.ndarray  # [L+1] in [0, 1] (1 = closed)
    joints: np.ndarray  # [L+1, 7]


def simulate(rng: np.random.Generator, length: int) -> Trajectory:
    """A smooth random reach: sums of slow sinusoids, one trajectory sample more than the episode (for targets)."""
    t = np.arange(length + 1)[:, None] / 60.0
    freq = rng.uniform(0.3, 1.2, size=(1, 10))
    phase = rng.uniform(0, 2 * np.pi, size=(1, 10))
    amp = rng.uniform(0.3, 0.9, size=(1, 10))
    waves = amp * np.sin(2 * np.pi * freq * t + phase)  # [L+1, 10]
    joints = waves[:, :7]
    eef_xyz = np.tanh(np.stack([joints[:, 0] + 0.5 * joints[:, 1], joints[:, 2] - 0.3 * joints[:, 3], joints[:, 4]], 1))
    eef_rot = 0.5 * joints[:, 4:7]
    grip_phase = rng.uniform(0, 2 * np.pi)
    gripper = 0.5 + 0.5 * np.tanh(3 * np.sin(2 * np.pi * t[:, 0] / 4.0 + grip_phase))
    return Trajectory(eef_xyz, eef_rot, gripper, joints)


def render(traj: Trajectory, length: int, camera: int, height: int, width: int, seed: int) -> np.ndarray:
    """uint8 [L, H, W, 3]: a per-camera background, a static object and a marker that follows the end effector."""
    rng = np.random.default_rng(seed * 1000 + camera)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(40, 200, size=3).astype(np.float32)
    background = np.empty((height, width, 3), np.float32)
    for c in range(3):
        background[..., c] = base[c] + 30 * np.sin(xx / width * (2 + c) * np.pi) * np.cos(yy / height * (1 + c) * np.pi)
    oy, ox = rng.uniform(0.25, 0.75) * height, rng.uniform(0.25, 0.75) * width
    obj = (np.abs(yy - oy) < height * 0.08) & (np.abs(xx - ox) < height * 0.08)
    background[obj] = rng.uniform(0, 255, size=3)
    axes = [(0, 1), (1, 2), (0, 2)][camera % 3]
    frames = np.empty((length, height, width, 3), np.uint8)
    for i in range(length):
        u, v = traj.eef_xyz[i, axes[0]], traj.eef_xyz[i, axes[1]]
        cx, cy = (0.5 + 0.4 * u) * width, (0.5 - 0.4 * v) * height
        radius = height * (0.06 + 0.08 * (1.0 - traj.gripper[i]))
        if camera == 2:  # wrist: close-up, the marker fills the view as the gripper opens
            cx, cy, radius = width / 2 + 0.2 * width * u, height / 2, height * (0.15 + 0.25 * (1 - traj.gripper[i]))
        disc = (xx - cx) ** 2 + (yy - cy) ** 2 < radius**2
        img = background.copy()
        img[disc] = (255.0 * traj.gripper[i], 80.0, 255.0 * (1 - traj.gripper[i]))
        frames[i] = np.clip(img, 0, 255).astype(np.uint8)
    return frames


def png_cell(img: np.ndarray) -> dict:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG", compress_level=1)
    return {"bytes": buf.getvalue(), "path": None}


def episode_lengths(rng: np.random.Generator, n: int, layout: str) -> list[int]:
    extent = WINDOW_EXTENT[layout]
    lengths = rng.integers(extent + 10, extent + 110, size=n).tolist()
    if n >= 2:
        lengths[1] = int(rng.integers(extent // 2, extent - 1))  # shorter than one full window
    if n >= 3:
        lengths[2] = extent  # exactly one full window
    return lengths


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def feature(dtype: str, shape: list[int], names=None) -> dict:
    return {"dtype": dtype, "shape": shape, "names": names}


def video_feature(h: int, w: int, fps: int, codec: str) -> dict:
    info = {
        "video.fps": float(fps),
        "video.height": h,
        "video.width": w,
        "video.channels": 3,
        "video.codec": "av1" if codec == "av1" else "h264",
        "video.pix_fmt": "yuv420p",
        "video.is_depth_map": False,
        "has_audio": False,
    }
    return {"dtype": "video", "shape": [h, w, 3], "names": ["height", "width", "channels"], "info": info}


def basic_stats(columns: dict[str, np.ndarray]) -> dict:
    out = {}
    for key, arr in columns.items():
        a = np.asarray(arr, dtype=np.float64).reshape(len(arr), -1)
        out[key] = {
            "min": a.min(0).tolist(),
            "max": a.max(0).tolist(),
            "mean": a.mean(0).tolist(),
            "std": a.std(0).tolist(),
            "count": [len(a)],
        }
    return out


def list_column(arr: np.ndarray, value_type) -> pa.Array:
    return pa.array(arr.tolist(), type=pa.list_(value_type))


# ---------------------------------------------------------------- DROID (v2.1, 3 mp4 cameras, 15 fps)


def _droid_videos(
    out: Path, traj: Trajectory, length: int, ep: int, h: int, w: int, fps: int, seed: int, codec: str
) -> None:
    chunk = ep // 1000
    for cam_i, cam in enumerate(DROID_CAMERAS):
        frames = render(traj, length, cam_i, h, w, seed * 100 + ep)
        encode_mp4(out / f"videos/chunk-{chunk:03d}/observation.images.{cam}/episode_{ep:06d}.mp4", frames, fps, codec)


def _libero_images(traj: Trajectory, length: int, ep: int, size: int, seed: int) -> dict:
    return {
        cam: [png_cell(f) for f in render(traj, length, i * 2, size, size, seed * 100 + ep)]
        for i, cam in enumerate(LIBERO_CAMERAS)
    }


def _pool(workers: int):
    """Render and compress frames in `workers` processes (the random draws stay in the parent, in episode order, so
    the files do not depend on `workers`)."""
    import multiprocessing

    return (
        ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) if workers > 1 else nullcontext()
    )


def make_droid(out: Path, episodes: int, seed: int, codec: str, workers: int = 1, raw: bool = False) -> None:
    with _pool(workers) as pool:
        _make_droid(out, episodes, seed, codec, pool, raw)


# ---------------------------------------------------------------- raw DROID: idle stretches, failures, language


@dataclass(frozen=True)
class RawEpisode:
    """One episode of the raw layout: which rows the robot moves in, whether it failed, its three instructions."""

    segments: tuple[tuple[str, int], ...]  # ("move" | "idle", rows), in order
    failed: bool
    instructions: tuple[str, str, str]

    @property
    def moving(self) -> np.ndarray:
        return np.concatenate([np.full(n, kind == "move") for kind, n in self.segments])

    @property
    def length(self) -> int:
        return sum(n for _, n in self.segments)


def raw_plan(ep: int) -> RawEpisode:
    """Episode `ep` of the raw layout: eight kinds in turn, each a case of DreamZero's DROID filters
    (docs/REFERENCE.md#1-source-datasets). `u(k, x)` is an instruction no other episode shows first."""
    cycle, kind = divmod(ep, 8)

    def u(k: int, x: str) -> str:
        return f"{DROID_TASKS[(k + cycle) % len(DROID_TASKS)]} ({cycle}{x})"

    np_ = "not provided"
    plans = {
        0: ((("move", 130),), False, (u(0, "a"), u(1, "b"), np_)),
        1: ((("move", 130),), True, (u(2, "c"), np_, u(3, "d"))),  # failed; its instructions are seen all the same
        2: ((("move", 130),), False, (u(0, "a"), np_, u(1, "b"))),  # every instruction seen before
        3: ((("move", 130),), False, (np_, "x", np_)),  # none provided (one character does not count)
        4: ((("idle", 60),), False, (u(4, "e"), np_, np_)),  # idle throughout: no keep range
        5: ((("idle", 12), ("move", 70), ("idle", 20), ("move", 90)), False, (u(2, "c"), u(5, "f"), np_)),
        6: ((("move", 130),), False, (u(3, "d"), np_, np_)),  # seen only in the failed episode 1
        7: ((("move", 40), ("idle", 10), ("move", 12), ("idle", 8), ("move", 120)), False, (u(0, "g"), np_, np_)),
    }
    segments, failed, instructions = plans[kind]
    return RawEpisode(segments, failed, instructions)


def raw_identity(ep: int) -> tuple[str, str]:
    """(recording_folderpath, file_path) of a raw episode, in DROID's form."""
    folder = f"gs://gresearch/robotics/droid_raw/1.0.1/LAB/success/2023-07-{1 + ep % 28:02d}/ep{ep:06d}"
    return f"{folder}/recordings/MP4", f"{folder}/trajectory.h5"


def nonidle_ranges(moving: np.ndarray, min_run: int = 16, trim: int = 10) -> list[tuple[int, int]]:
    """The keep ranges openpi's script would store for these moving rows: each moving run of at least `min_run`
    rows as [start, end - trim)."""
    edges = np.flatnonzero(np.diff(np.r_[0, moving.astype(np.int8), 0]))
    return [(int(a), int(b) - trim) for a, b in zip(edges[::2], edges[1::2]) if b - a >= min_run]


def hold(traj: Trajectory, moving: np.ndarray) -> Trajectory:
    """A trajectory of len(moving) + 1 samples that advances on moving rows and stands still on idle ones."""
    step = np.r_[0, np.cumsum(moving)]  # sample of `traj` at each row, and one more for the last target
    return Trajectory(traj.eef_xyz[step], traj.eef_rot[step], traj.gripper[step], traj.joints[step])


def keep_ranges_path(root: Path) -> Path:
    """Where the raw layout's keep-ranges file is written: beside the dataset, as openpi's file is."""
    return root.with_name(root.name + "_keep_ranges.json")


def _make_droid(out: Path, episodes: int, seed: int, codec: str, pool, raw: bool = False) -> None:
    rng = np.random.default_rng(seed)
    fps, h, w = 15, 180, 320
    plans = [raw_plan(ep) for ep in range(episodes)] if raw else None
    tasks = ["not provided"] + DROID_TASKS
    if plans is not None:
        tasks = ["not provided", "x"] + list(
            dict.fromkeys(t for p in plans for t in p.instructions if t not in ("not provided", "x"))
        )
    lengths = episode_lengths(rng, episodes, "droid") if plans is None else [p.length for p in plans]
    episode_rows, stats_rows, videos, keep_ranges = [], [], [], {}
    for ep, length in enumerate(lengths):
        if plans is None:
            traj = simulate(rng, length)
        else:
            moving = plans[ep].moving
            traj = hold(simulate(rng, int(moving.sum())), moving)
        cart = np.concatenate([traj.eef_xyz, traj.eef_rot], 1)
        state = np.concatenate([cart[:-1], traj.gripper[:-1, None], traj.joints[:-1]], 1)  # [L, 14]
        action = np.concatenate(
            [
                cart[1:],
                (cart[1:] - cart[:-1]) * fps,
                traj.gripper[1:, None],
                (traj.gripper[1:, None] - traj.gripper[:-1, None]) * fps,
                traj.joints[1:],
                (traj.joints[1:] - traj.joints[:-1]) * fps,
            ],
            1,
        )  # [L, 28]: each action is the next state's target
        if plans is None:
            first = 1 + int(rng.integers(len(DROID_TASKS)))
            second = 0 if ep % 2 else 1 + int(rng.integers(len(DROID_TASKS)))  # "not provided" for some episodes
            third = 1 + int(rng.integers(len(DROID_TASKS)))
            reward = np.r_[np.zeros(length - 1), 1.0]
        else:
            first, second, third = (tasks.index(t) for t in plans[ep].instructions)
            reward = np.r_[np.zeros(length - 1), 0.0 if plans[ep].failed else 1.0]
        annotation = {
            "annotation.language.language_instruction": first,
            "annotation.language.language_instruction_2": second,
            "annotation.language.language_instruction_3": third,
        }
        chunk = ep // 1000
        frame_index = np.arange(length)
        table = pa.table(
            {
                "observation.state": list_column(state, pa.float64()),
                "action": list_column(action, pa.float64()),
                "timestamp": pa.array((frame_index / fps).astype(np.float32)),
                "frame_index": pa.array(frame_index, pa.int64()),
                "episode_index": pa.array(np.full(length, ep), pa.int64()),
                "task_index": pa.array(np.full(length, first), pa.int64()),
                **{k: pa.array(np.full(length, v), pa.int64()) for k, v in annotation.items()},
                "next.reward": pa.array(reward.astype(np.float32)),
                "next.done": pa.array(np.r_[np.zeros(length - 1, bool), True]),
                "is_terminal": pa.array(np.r_[np.zeros(length - 1, bool), True]),
                "is_first": pa.array(np.r_[True, np.zeros(length - 1, bool)]),
                "discount": pa.array(np.ones(length, np.float32)),
            }
        )
        data_path = out / f"data/chunk-{chunk:03d}/episode_{ep:06d}.parquet"
        data_path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, data_path)
        args = (out, traj, length, ep, h, w, fps, seed, codec)
        if pool:
            videos.append(pool.submit(_droid_videos, *args))
        else:
            _droid_videos(*args)
        ep_tasks = [tasks[i] for i in dict.fromkeys([first, second, third])]
        row = {"episode_index": ep, "tasks": ep_tasks, "length": length, "success": True}
        if plans is not None:  # the raw episode's identity, as DROID's episode metadata names it
            folder, file = raw_identity(ep)
            row |= {"success": not plans[ep].failed, "recording_folderpath": folder, "file_path": file}
            keep_ranges[f"{folder}--{file}"] = [list(r) for r in nonidle_ranges(plans[ep].moving)]
        episode_rows.append(row)
        stats_rows.append({"episode_index": ep, "stats": basic_stats({"observation.state": state, "action": action})})
    for done in videos:
        done.result()  # a worker's error raised here
    if plans is not None:
        write_json(keep_ranges_path(out), keep_ranges)

    features = {f"observation.images.{c}": video_feature(h, w, fps, codec) for c in DROID_CAMERAS}
    features |= {
        "observation.state": feature(
            "float64", [14], ["cartesian_position"] * 6 + ["gripper_position"] + ["joint_position"] * 7
        ),
        "action": feature("float64", [28]),
        "timestamp": feature("float32", [1]),
        "frame_index": feature("int64", [1]),
        "episode_index": feature("int64", [1]),
        "task_index": feature("int64", [1]),
        "annotation.language.language_instruction": feature("int64", [1]),
        "annotation.language.language_instruction_2": feature("int64", [1]),
        "annotation.language.language_instruction_3": feature("int64", [1]),
        "next.reward": feature("float32", [1]),
        "next.done": feature("bool", [1]),
        "is_terminal": feature("bool", [1]),
        "is_first": feature("bool", [1]),
        "discount": feature("float32", [1]),
    }
    write_json(
        out / "meta/info.json",
        {
            "codebase_version": "v2.1",
            "robot_type": "franka",
            "total_episodes": episodes,
            "total_frames": sum(lengths),
            "total_tasks": len(tasks),
            "total_videos": episodes * len(DROID_CAMERAS),
            "total_chunks": 1,
            "chunks_size": 1000,
            "fps": fps,
            "splits": {"train": f"0:{episodes}"},
            "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
            "video_path": "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4",
            "features": features,
        },
    )
    write_jsonl(out / "meta/tasks.jsonl", [{"task_index": i, "task": t} for i, t in enumerate(tasks)])
    write_jsonl(out / "meta/episodes.jsonl", episode_rows)
    write_jsonl(out / "meta/episodes_stats.jsonl", stats_rows)
    write_json(
        out / "meta/modality.json",
        {
            "state": {
                "cartesian_position": {"start": 0, "end": 6},
                "gripper_position": {"start": 6, "end": 7},
                "joint_position": {"start": 7, "end": 14},
            },
            "action": {
                "cartesian_position": {"start": 0, "end": 6},
                "cartesian_velocity": {"start": 6, "end": 12},
                "gripper_position": {"start": 12, "end": 13},
                "gripper_velocity": {"start": 13, "end": 14},
                "joint_position": {"start": 14, "end": 21},
                "joint_velocity": {"start": 21, "end": 28},
            },
            "video": {c: {"original_key": f"observation.images.{c}"} for c in DROID_CAMERAS},
            "annotation": {
                "language.language_instruction": {},
                "language.language_instruction_2": {},
                "language.language_instruction_3": {},
            },
        },
    )


# ---------------------------------------------------------------- LIBERO (v2.0 images in parquet / v3.0 mp4), 10 fps


def libero_episode(rng: np.random.Generator, length: int):
    traj = simulate(rng, length)
    grip_q = np.stack([0.04 * (1 - traj.gripper[:-1]), -0.04 * (1 - traj.gripper[:-1])], 1)
    state = np.concatenate([traj.eef_xyz[:-1], traj.eef_rot[:-1], grip_q], 1).astype(np.float32)  # [L, 8]
    delta = np.concatenate([traj.eef_xyz[1:] - traj.eef_xyz[:-1], traj.eef_rot[1:] - traj.eef_rot[:-1]], 1) * 10
    gripper_cmd = np.where(traj.gripper[1:] > 0.5, 1.0, -1.0)[:, None]
    actions = np.concatenate([np.clip(delta, -1, 1), gripper_cmd], 1).astype(np.float32)  # [L, 7]
    return traj, state, actions


def libero_features(camera_feature: dict) -> dict:
    return {
        **{c: camera_feature for c in LIBERO_CAMERAS},
        "state": feature("float32", [8], ["state"]),
        "actions": feature("float32", [7], ["actions"]),
        "timestamp": feature("float32", [1]),
        "frame_index": feature("int64", [1]),
        "episode_index": feature("int64", [1]),
        "index": feature("int64", [1]),
        "task_index": feature("int64", [1]),
    }


def libero_rows(ep: int, length: int, offset: int, task: int, state: np.ndarray, actions: np.ndarray, fps: int) -> dict:
    frame_index = np.arange(length)
    return {
        "state": list_column(state, pa.float32()),
        "actions": list_column(actions, pa.float32()),
        "timestamp": pa.array((frame_index / fps).astype(np.float32)),
        "frame_index": pa.array(frame_index, pa.int64()),
        "episode_index": pa.array(np.full(length, ep), pa.int64()),
        "index": pa.array(offset + frame_index, pa.int64()),
        "task_index": pa.array(np.full(length, task), pa.int64()),
    }


def libero_info(
    version: str, episodes: int, lengths: list[int], features: dict, paths: dict, videos: int, fps: int
) -> dict:
    return {
        "codebase_version": version,
        "robot_type": "panda",
        "total_episodes": episodes,
        "total_frames": sum(lengths),
        "total_tasks": len(LIBERO_TASKS),
        "total_videos": videos,
        "total_chunks": 1,
        "chunks_size": 1000,
        "fps": fps,
        "splits": {"train": f"0:{episodes}"},
        **paths,
        "features": features,
    }


def make_libero(out: Path, episodes: int, seed: int, workers: int = 1) -> None:
    rng = np.random.default_rng(seed)
    fps, size = 10, 256
    lengths = episode_lengths(rng, episodes, "libero")
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    drawn = []  # every random draw first, in episode order; the frames after, in any number of processes
    for ep, length in enumerate(lengths):
        traj, state, actions = libero_episode(rng, length)
        drawn.append((traj, state, actions, int(rng.integers(len(LIBERO_TASKS)))))
    episode_rows, offset, all_state, all_actions = [], 0, [], []
    with _pool(workers) as pool:
        args = [(traj, length, ep, size, seed) for ep, (length, (traj, *_)) in enumerate(zip(lengths, drawn))]
        images = pool.map(_libero_images, *zip(*args)) if pool else (_libero_images(*a) for a in args)
        for ep, (length, (traj, state, actions, task), cells) in enumerate(zip(lengths, drawn, images)):
            _write_libero_episode(
                out,
                ep,
                length,
                offset,
                task,
                state,
                actions,
                fps,
                {cam: pa.array(cells[cam], image_type) for cam in LIBERO_CAMERAS},
            )
            episode_rows.append({"episode_index": ep, "tasks": [LIBERO_TASKS[task]], "length": length})
            offset += length
            all_state.append(state)
            all_actions.append(actions)
    image = feature("image", [size, size, 3], ["height", "width", "channel"])
    write_json(
        out / "meta/info.json",
        libero_info(
            "v2.0",
            episodes,
            lengths,
            libero_features(image),
            {"data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet", "video_path": None},
            0,
            fps,
        ),
    )
    write_jsonl(out / "meta/tasks.jsonl", [{"task_index": i, "task": t} for i, t in enumerate(LIBERO_TASKS)])
    write_jsonl(out / "meta/episodes.jsonl", episode_rows)
    write_json(
        out / "meta/stats.json",
        basic_stats({"state": np.concatenate(all_state), "actions": np.concatenate(all_actions)}),
    )


def _write_libero_episode(
    out: Path, ep: int, length: int, offset: int, task: int, state, actions, fps: int, columns: dict
) -> None:
    columns |= libero_rows(ep, length, offset, task, state, actions, fps)
    path = out / f"data/chunk-000/episode_{ep:06d}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)


def make_libero_v3(
    out: Path, episodes: int, seed: int, codec: str, episodes_per_data_file: int = 3, episodes_per_video_file: int = 2
) -> None:
    """Same content as `make_libero` for the same seed, in the v3.0 layout: multi-episode parquet and mp4 files."""
    rng = np.random.default_rng(seed)
    fps, size = 10, 256
    lengths = episode_lengths(rng, episodes, "libero-v3")
    data_tables: dict[int, list[pa.Table]] = {}
    video_frames: dict[tuple[str, int], list[np.ndarray]] = {}
    meta_rows, offset, all_state, all_actions = [], 0, [], []
    for ep, length in enumerate(lengths):
        traj, state, actions = libero_episode(rng, length)
        task = int(rng.integers(len(LIBERO_TASKS)))
        data_file, video_file = ep // episodes_per_data_file, ep // episodes_per_video_file
        data_tables.setdefault(data_file, []).append(
            pa.table(libero_rows(ep, length, offset, task, state, actions, fps))
        )
        row = {
            "episode_index": ep,
            "tasks": [LIBERO_TASKS[task]],
            "length": length,
            "data/chunk_index": 0,
            "data/file_index": data_file,
            "dataset_from_index": offset,
            "dataset_to_index": offset + length,
        }
        for i, cam in enumerate(LIBERO_CAMERAS):
            parts = video_frames.setdefault((cam, video_file), [])
            start = sum(len(p) for p in parts) / fps
            parts.append(render(traj, length, i * 2, size, size, seed * 100 + ep))
            row |= {
                f"videos/{cam}/chunk_index": 0,
                f"videos/{cam}/file_index": video_file,
                f"videos/{cam}/from_timestamp": start,
                f"videos/{cam}/to_timestamp": start + length / fps,
            }
        meta_rows.append(row)
        offset += length
        all_state.append(state)
        all_actions.append(actions)
    for file_index, tables in data_tables.items():
        path = out / f"data/chunk-000/file-{file_index:03d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.concat_tables(tables), path)
    for (cam, file_index), parts in video_frames.items():
        encode_mp4(out / f"videos/{cam}/chunk-000/file-{file_index:03d}.mp4", np.concatenate(parts), fps, codec)
    (out / "meta/episodes/chunk-000").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(meta_rows), out / "meta/episodes/chunk-000/file-000.parquet")
    pq.write_table(
        pa.table({"task_index": pa.array(range(len(LIBERO_TASKS)), pa.int64()), "task": LIBERO_TASKS}),
        out / "meta/tasks.parquet",
    )
    paths = {
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
        "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
    }
    info = libero_info(
        "v3.0",
        episodes,
        lengths,
        libero_features(video_feature(size, size, fps, codec)),
        paths,
        episodes * len(LIBERO_CAMERAS),
        fps,
    )
    info |= {"data_files_size_in_mb": 100, "video_files_size_in_mb": 200}
    write_json(out / "meta/info.json", info)
    write_json(
        out / "meta/stats.json",
        basic_stats({"state": np.concatenate(all_state), "actions": np.concatenate(all_actions)}),
    )


LAYOUTS = ("droid", "droid-raw", "libero", "libero-v3")


def write_sample_dataset(
    out: Path, layout: str, episodes: int = 4, seed: int = 0, codec: str = "h264", workers: int = 1
) -> Path:
    """Write the `layout` dataset to `out` (replaced if it exists); returns `out`. `workers` processes render and
    compress the frames of the droid and libero layouts (the same files for any number)."""
    if episodes < 1:
        raise ValueError(f"episodes must be at least 1, got {episodes}")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    if layout in ("droid", "droid-raw"):
        make_droid(out, episodes, seed, codec, workers, raw=layout == "droid-raw")
    elif layout == "libero":
        make_libero(out, episodes, seed, workers)
    elif layout == "libero-v3":
        make_libero_v3(out, episodes, seed, codec)
    else:
        raise ValueError(f"unknown layout {layout!r}, expected one of {LAYOUTS}")
    return out
