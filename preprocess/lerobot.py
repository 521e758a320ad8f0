"""Read LeRobot datasets (v2.0, v2.1, v3.0; mp4 videos or images inside parquet) episode by episode.

Paths always come from the templates in `meta/info.json`; nothing about file names is guessed. An episode hands
out its parquet columns (only those asked for), one frame source per camera, and its instruction strings per
annotation column. Frames are decoded by `preprocess.decode` when a source is read, never earlier.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from wampipe.preprocess.decode import decode_image_cells, decode_video
from wampipe.preprocess.errors import DatasetError

SUPPORTED_VERSIONS = ("v2.0", "v2.1", "v3.0")
Ranges = Sequence[tuple[int, int]]  # half-open [start, end) row ranges of an episode, ascending and disjoint
IMAGE_PREFIX = "observation.images."


# ---------------------------------------------------------------- modality.json (GEAR/Groot extension)


@dataclass(frozen=True)
class ModalityEntry:
    """One state/action sub-key: `np.stack(column)[:, start:end]`."""

    original_key: str
    start: int
    end: int
    absolute: bool = True
    dtype: str = "float64"

    @property
    def dim(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Modality:
    state: dict[str, ModalityEntry]
    action: dict[str, ModalityEntry]
    video: dict[str, str]  # short camera name -> parquet/feature key
    annotation: dict[str, str]  # annotation sub-key -> parquet column


def _parse_modality(raw: dict, path: Path) -> Modality:
    def vectors(section: str, default_key: str) -> dict[str, ModalityEntry]:
        out = {}
        for sub, spec in (raw.get(section) or {}).items():
            if "start" not in spec or "end" not in spec:
                raise DatasetError(path, None, f"{section}.{sub} needs 'start' and 'end'")
            out[sub] = ModalityEntry(
                original_key=spec.get("original_key", default_key),
                start=int(spec["start"]),
                end=int(spec["end"]),
                absolute=bool(spec.get("absolute", True)),
                dtype=str(spec.get("dtype", "float64")),
            )
        return out

    video = {s: (v or {}).get("original_key", IMAGE_PREFIX + s) for s, v in (raw.get("video") or {}).items()}
    annotation = {s: (v or {}).get("original_key", "annotation." + s) for s, v in (raw.get("annotation") or {}).items()}
    return Modality(vectors("state", "observation.state"), vectors("action", "action"), video, annotation)


def _infer_modality(features: dict) -> Modality:
    """No modality.json (e.g. physical-intelligence/libero): one sub-key per whole state/action vector."""

    def vector(candidates: Sequence[str]) -> dict[str, ModalityEntry]:
        for key in candidates:
            if key in features:
                dim = int(np.prod(features[key]["shape"]))
                return {key.split(".")[-1]: ModalityEntry(key, 0, dim, dtype=features[key]["dtype"])}
        return {}

    cameras = [k for k, f in features.items() if f.get("dtype") in ("video", "image")]
    video = {k.removeprefix(IMAGE_PREFIX): k for k in cameras}
    annotation = {k.removeprefix("annotation."): k for k in features if k.startswith("annotation.")}
    return Modality(vector(["observation.state", "state"]), vector(["action", "actions"]), video, annotation)


# ---------------------------------------------------------------- frame sources


@dataclass(frozen=True)
class VideoFrames:
    """One camera of one episode inside an mp4 (v3: a span of a file shared by several episodes)."""

    path: Path
    episode: int
    length: int
    fps: float
    from_timestamp: float = 0.0
    row_timestamps: np.ndarray | None = None  # parquet `timestamp` per row handed out, relative to the episode
    # the recorded row of each row handed out, ascending (an episode cut to its keep ranges); None: every row
    source_rows: np.ndarray | None = None
    source_length: int | None = None  # the recorded episode's rows (default: `length`)

    @property
    def first_frame(self) -> int:
        return int(round(self.from_timestamp * self.fps))

    def read(self, rows: Sequence[int] | np.ndarray | None = None, backend: str = "torchcodec") -> np.ndarray:
        """uint8 [N, H, W, 3] for episode rows (all rows by default), decoded front to back in one pass."""
        index = np.arange(self.length) if rows is None else np.asarray(rows, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= self.length):
            raise DatasetError(
                self.path, self.episode, f"rows {index.min()}..{index.max()} outside 0..{self.length - 1}"
            )
        expected = None
        if self.row_timestamps is not None:
            expected = self.from_timestamp + self.row_timestamps[index]
        recorded = index if self.source_rows is None else self.source_rows[index]
        return decode_video(
            self.path,
            self.first_frame + recorded,
            backend=backend,
            episode=self.episode,
            expected_pts=expected,
            fps=self.fps,
            required_frames=self.first_frame + (self.length if self.source_length is None else self.source_length),
        )


@dataclass(frozen=True)
class ParquetImageFrames:
    """One camera of one episode stored as encoded PNG/JPEG cells of a parquet column (`dtype: image`)."""

    path: Path
    episode: int
    column: str
    cells: tuple  # per row: bytes

    @property
    def length(self) -> int:
        return len(self.cells)

    def read(self, rows: Sequence[int] | np.ndarray | None = None, backend: str = "torchcodec") -> np.ndarray:
        del backend  # images are not videos; the argument keeps one signature for both sources
        rows = list(range(self.length) if rows is None else rows)
        return decode_image_cells([self.cells[r] for r in rows], self.path, self.episode, self.column, rows)


FrameSource = VideoFrames | ParquetImageFrames


# ---------------------------------------------------------------- episodes


@dataclass(frozen=True)
class EpisodeInfo:
    index: int
    length: int
    data_path: Path
    video_paths: dict[str, Path] = field(default_factory=dict)  # feature key -> mp4
    video_from_timestamp: dict[str, float] = field(default_factory=dict)
    video_to_timestamp: dict[str, float] = field(default_factory=dict)
    fields: dict = field(default_factory=dict)  # the scalar fields of its meta/episodes row (string, number, bool)


@dataclass
class Episode:
    index: int
    length: int
    columns: dict[str, np.ndarray]  # parquet column -> row-aligned array ([L] or [L, d])
    cameras: dict[str, FrameSource]  # short camera name (modality.json) -> frame source
    annotations: dict[str, np.ndarray]  # annotation column -> instruction string per row (object array)
    # annotation column -> file its strings are in: its parquet, or meta/tasks.* (the dataset's tasks_file)
    annotation_files: dict[str, Path | None] = field(default_factory=dict)

    @property
    def instructions(self) -> dict[str, str]:
        """Instruction per annotation column at the episode's first row (constant per episode in DROID/LIBERO)."""
        return {k: str(v[0]) for k, v in self.annotations.items() if len(v)}

    def slice(self, entry: ModalityEntry, path: Path | None = None) -> np.ndarray:
        """A modality sub-key as a float array [L, end - start]; DatasetError (naming `path`, the episode's data file)
        when the column is not that wide."""
        if entry.original_key not in self.columns:
            raise KeyError(f"column {entry.original_key!r} was not read; pass it in `columns`")
        column = self.columns[entry.original_key]
        if column.ndim != 2 or column.shape[1] < entry.end:
            raise DatasetError(
                path,
                self.index,
                f"column {entry.original_key!r} has shape {list(column.shape)}, "
                f"modality.json takes its columns {entry.start}..{entry.end - 1}",
            )
        return column[:, entry.start : entry.end]


class LeRobotDataset:
    """A LeRobot dataset root. Cheap to open: only `meta/` is read until an episode is asked for.

    `kept` (preprocess.selection) narrows it to some episodes, each whole (None) or cut to its keep ranges: the
    dataset then hands out only those episodes, each as the concatenation of its ranges, as DreamZero's DROID
    conversion writes them; `episode_info` still describes the recorded episode."""

    def __init__(self, root: str | Path, kept: Mapping[int, Ranges | None] | None = None):
        self.root = Path(root)
        info_path = self.root / "meta" / "info.json"
        if not info_path.is_file():
            raise DatasetError(info_path, None, "not a LeRobot dataset: meta/info.json is missing")
        self.info = _read_json(info_path)
        self.version = str(self.info.get("codebase_version", ""))
        if self.version not in SUPPORTED_VERSIONS:
            raise DatasetError(info_path, None, f"codebase_version {self.version!r} is not one of {SUPPORTED_VERSIONS}")
        for key in ("data_path", "features", "fps"):
            if key not in self.info:
                raise DatasetError(info_path, None, f"'{key}' is missing")
        self.fps = _number(self.info["fps"], info_path, "fps", float)
        self.features: dict = self.info["features"]
        self.chunks_size = _number(self.info.get("chunks_size", 1000), info_path, "chunks_size", int)
        if not isinstance(self.features, dict):
            raise DatasetError(info_path, None, "'features' is not a JSON object")
        for name, feature in self.features.items():
            if not isinstance(feature, dict) or not isinstance(feature.get("dtype"), str):
                raise DatasetError(info_path, None, f"feature {name!r} has no dtype")
        modality_path = self.root / "meta" / "modality.json"
        self.modality = (
            _parse_modality(_read_json(modality_path), modality_path)
            if modality_path.is_file()
            else _infer_modality(self.features)
        )
        for short, key in self.modality.video.items():
            if key not in self.features:
                raise DatasetError(modality_path, None, f"camera {short!r} maps to {key!r}, not a feature in info.json")
        tasks = (self.root / "meta" / "tasks.jsonl", self.root / "meta" / "tasks.parquet")
        self.tasks_file = next((path for path in tasks if path.is_file()), None)
        self.tasks = self._read_tasks()
        self._episodes = self._read_episodes()
        self._by_index = {e.index: e for e in self._episodes}
        if len(self._by_index) != len(self._episodes):  # one episode twice would be encoded twice
            seen: set[int] = set()
            twice = next(e.index for e in self._episodes if e.index in seen or seen.add(e.index))
            listing = self.root / "meta" / ("episodes" if self.is_v3 else "episodes.jsonl")
            raise DatasetError(listing, twice, "listed twice")
        self._table_cache: OrderedDict[Path, pa.Table] = OrderedDict()
        self._kept: dict[int, Ranges | None] | None = None  # ranges, not rows: all of DROID is 2e7 rows
        if kept is not None:
            unknown = sorted(set(kept) - self._by_index.keys())
            if unknown:
                raise DatasetError(self.root, unknown[0], "selected but not in meta/")
            self._kept = {e.index: kept[e.index] for e in self._episodes if e.index in kept}

    # -- metadata

    @property
    def is_v3(self) -> bool:
        return self.version == "v3.0"

    @property
    def camera_keys(self) -> list[str]:
        return [k for k, f in self.features.items() if f.get("dtype") in ("video", "image")]

    def camera_storage(self, key: str) -> str:
        """'video' (mp4) or 'image' (encoded cells inside parquet)."""
        return "video" if self.features[key]["dtype"] == "video" else "image"

    def camera_shape(self, key: str) -> tuple[int, int, int]:
        """(height, width, channels) as declared in info.json."""
        feature = self.features[key]
        names = feature.get("names") or ["height", "width", "channels"]
        dims = dict(zip(names, feature["shape"]))
        if {"height", "width"} <= dims.keys():
            return int(dims["height"]), int(dims["width"]), int(dims.get("channels", dims.get("channel", 3)))
        h, w, c = feature["shape"]
        return int(h), int(w), int(c)

    @property
    def episode_indices(self) -> list[int]:
        """The episodes it hands out (all, or the kept ones), in index order."""
        return [e.index for e in self._episodes] if self._kept is None else list(self._kept)

    def episode_info(self, episode_index: int) -> EpisodeInfo:
        try:
            return self._by_index[episode_index]
        except KeyError:
            raise DatasetError(self.root, episode_index, "no such episode in meta/") from None

    def source_rows(self, episode_index: int) -> np.ndarray | None:
        """The recorded rows an episode is cut to, ascending (None: every row)."""
        return _rows(self._ranges(episode_index))

    def length(self, episode_index: int) -> int:
        """The rows the episode has as handed out (after any cut)."""
        ranges = self._ranges(episode_index)
        return self.episode_info(episode_index).length if ranges is None else sum(e - s for s, e in ranges)

    def _ranges(self, episode_index: int) -> Ranges | None:
        self.episode_info(episode_index)  # a DatasetError for an episode meta/ does not list
        if self._kept is None:
            return None
        if episode_index not in self._kept:
            raise DatasetError(self.root, episode_index, "not among the selected episodes")
        return self._kept[episode_index]

    def __len__(self) -> int:
        return len(self.episode_indices)

    @property
    def total_frames(self) -> int:
        return sum(self.length(e) for e in self.episode_indices)

    # -- episodes

    def episode(self, episode_index: int, columns: Sequence[str] = (), cameras: bool = True) -> Episode:
        """One episode with the asked parquet columns, its instructions and (unless `cameras=False`, which skips
        reading image cells and checking videos) its cameras, cut to its keep ranges if it has some. Validates
        lengths."""
        info = self.episode_info(episode_index)
        kept = self.source_rows(episode_index)
        annotation_cols = list(self.modality.annotation.values()) or (
            ["task_index"] if "task_index" in self.features else []
        )
        video = self.modality.video if cameras else {}
        image_cols = [key for key in video.values() if self.camera_storage(key) == "image"]
        wanted = list(dict.fromkeys([*columns, *annotation_cols, *image_cols, "timestamp"]))
        table = self._episode_table(info, wanted)
        if table.num_rows != info.length:
            raise DatasetError(
                info.data_path, episode_index, f"parquet has {table.num_rows} rows, meta says length {info.length}"
            )
        if kept is not None:  # every later check and column sees only the rows the episode keeps
            table = table.take(pa.array(kept))
        length = table.num_rows

        cols = {c: _column_to_numpy(table, c, info.data_path, episode_index) for c in columns}
        for c, values in cols.items():
            # finite in the dtype the shards store (float32): 1e39 is finite in float64 and inf once stored
            if values.dtype.kind == "f" and not np.isfinite(values.astype(np.float32, copy=False)).all():
                raise DatasetError(info.data_path, episode_index, f"column {c!r} holds NaN or inf")
        timestamps = (
            table.column("timestamp").to_numpy().astype(np.float64) if "timestamp" in table.column_names else None
        )
        if timestamps is not None and not np.isfinite(timestamps).all():  # NaN would pass every frame's check
            raise DatasetError(info.data_path, episode_index, "column 'timestamp' holds NaN or inf")

        sources: dict[str, FrameSource] = {}
        for short, key in video.items():
            if self.camera_storage(key) == "image":
                cells = tuple(_image_bytes(v) for v in table.column(key).to_pylist())
                sources[short] = ParquetImageFrames(info.data_path, episode_index, key, cells)
            else:
                path = info.video_paths[key]
                if not path.is_file():
                    raise DatasetError(path, episode_index, f"video for camera {short!r} is missing")
                vfps = float(self.features[key].get("info", {}).get("video.fps", self.fps))
                from_ts = info.video_from_timestamp.get(key, 0.0)
                if key in info.video_to_timestamp:
                    n = round((info.video_to_timestamp[key] - from_ts) * vfps)
                    if n != info.length:
                        raise DatasetError(
                            path, episode_index, f"video span holds {n} frames, episode has {info.length} rows"
                        )
                sources[short] = VideoFrames(path, episode_index, length, vfps, from_ts, timestamps, kept, info.length)

        instructions = {c: self._instructions(table, c, info) for c in annotation_cols}
        return Episode(
            episode_index,
            length,
            cols,
            sources,
            {c: v for c, (v, _) in instructions.items()},
            {c: file for c, (_, file) in instructions.items()},
        )

    def episodes(
        self, columns: Sequence[str] = (), indices: Sequence[int] | None = None, cameras: bool = True
    ) -> Iterator[Episode]:
        for i in self.episode_indices if indices is None else indices:
            yield self.episode(i, columns, cameras)

    # -- internals

    def _instructions(self, table: pa.Table, column: str, info: EpisodeInfo) -> tuple[np.ndarray, Path | None]:
        """The instruction of each row and the file holding them: the parquet's own strings, or meta/tasks.* for
        task indices."""
        values = table.column(column).to_pylist()
        out = np.empty(len(values), dtype=object)
        for i, v in enumerate(values):
            if isinstance(v, str):
                out[i] = v
            elif v is None or int(v) not in self.tasks:
                raise DatasetError(
                    info.data_path, info.index, f"{column}[{i}] = {v!r} is not a task index in meta/tasks"
                )
            else:
                out[i] = self.tasks[int(v)]
        return out, info.data_path if all(isinstance(v, str) for v in values) else self.tasks_file

    def _episode_table(self, info: EpisodeInfo, columns: list[str]) -> pa.Table:
        if not info.data_path.is_file():
            raise DatasetError(info.data_path, info.index, "parquet file is missing")
        present = [c for c in columns if c in self._schema_names(info.data_path)]
        missing = [c for c in columns if c not in present and c != "timestamp"]
        if missing:
            raise DatasetError(info.data_path, info.index, f"columns {missing} are not in the parquet file")
        if not self.is_v3:
            return _read_parquet(info.data_path, present, info.index)
        table = self._cached_file(info.data_path)
        # pyarrow.compute makes its functions at import, out of a checker's sight
        in_episode = pc.equal(table.column("episode_index"), info.index)  # pyright: ignore[reportAttributeAccessIssue]
        rows = table.filter(in_episode)
        if rows.num_rows and "frame_index" in rows.column_names:
            order = pc.sort_indices(rows.column("frame_index"))  # pyright: ignore[reportAttributeAccessIssue]
            rows = rows.take(order)
        return rows.select(present)

    def _cached_file(self, path: Path) -> pa.Table:
        # v3 files hold many episodes; episodes are read in order, so a small cache avoids re-reading a file.
        if path not in self._table_cache:
            self._table_cache[path] = _read_parquet(path, None, None)
            while len(self._table_cache) > 2:
                self._table_cache.popitem(last=False)
        return self._table_cache[path]

    def _schema_names(self, path: Path) -> set[str]:
        try:
            return set(pq.read_schema(path).names)
        except Exception as err:  # pyarrow raises several types for damaged files
            raise DatasetError(path, None, f"unreadable parquet: {err}") from err

    def _read_tasks(self) -> dict[int, str]:
        path = self.tasks_file
        if path is None:
            return {}
        if path.suffix == ".jsonl":
            rows = _read_jsonl(path)
            try:
                return {int(r["task_index"]): str(r["task"]) for r in rows}
            except (KeyError, TypeError, ValueError):
                raise DatasetError(path, None, "a row without an integer task_index and a task string") from None
        table = _read_parquet(path, None, None)
        names = table.column_names
        if "task" in names:
            tasks, idx = table.column("task").to_pylist(), table.column("task_index").to_pylist()
        else:  # LeRobot writes the task string as the pandas index
            idx = table.column("task_index").to_pylist()
            tasks = table.column(names[-1] if names[-1] != "task_index" else names[0]).to_pylist()
        return {int(i): str(t) for i, t in zip(idx, tasks)}

    def _read_episodes(self) -> list[EpisodeInfo]:
        return self._read_episodes_v3() if self.is_v3 else self._read_episodes_v2()

    def _read_episodes_v2(self) -> list[EpisodeInfo]:
        path = self.root / "meta" / "episodes.jsonl"
        if not path.is_file():
            raise DatasetError(path, None, "meta/episodes.jsonl is missing")
        discarded = set(self.info.get("discarded_episode_indices", []) or [])
        out = []
        for line, row in enumerate(_read_jsonl(path), 1):
            try:
                ep = _whole(row["episode_index"])
            except (KeyError, TypeError, ValueError):
                raise DatasetError(path, None, f"line {line}: no whole 'episode_index'") from None
            if ep in discarded:
                continue
            length = row.get("length", row.get("episode_length", row.get("num_frames")))
            if length is None:
                raise DatasetError(path, ep, "no 'length' field")
            try:
                length = _whole(length)
            except (TypeError, ValueError):
                raise DatasetError(path, ep, f"length {length!r} is not a whole number") from None
            chunk = ep // self.chunks_size
            data = self.root / self._path("data_path", episode_chunk=chunk, episode_index=ep)
            videos = {
                k: self.root / self._path("video_path", episode_chunk=chunk, video_key=k, episode_index=ep)
                for k in self.camera_keys
                if self.camera_storage(k) == "video"
            }
            out.append(EpisodeInfo(ep, length, data, videos, fields=_scalars(row)))
        return out

    def _path(self, field: str, **values) -> str:
        """info.json's path pattern `field` filled in; DatasetError naming it when it is missing or unusable."""
        pattern, info = self.info.get(field), self.root / "meta" / "info.json"
        if not isinstance(pattern, str):
            raise DatasetError(info, None, f"{field!r} is missing (needed for {', '.join(sorted(values))})")
        try:
            return pattern.format(**values)
        except (KeyError, IndexError, ValueError) as err:
            raise DatasetError(
                info, None, f"{field} {pattern!r}: unknown field or bad pattern ({type(err).__name__}: {err})"
            ) from None

    def _read_episodes_v3(self) -> list[EpisodeInfo]:
        files = sorted((self.root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
        if not files:
            raise DatasetError(self.root / "meta" / "episodes", None, "no chunk-*/file-*.parquet episode files")
        out = []
        for f in files:
            for row in pq.read_table(f).to_pylist():
                ep = int(row["episode_index"])
                try:
                    data = self.root / self._path(
                        "data_path", chunk_index=row["data/chunk_index"], file_index=row["data/file_index"]
                    )
                    videos, from_ts, to_ts = {}, {}, {}
                    for k in self.camera_keys:
                        if self.camera_storage(k) != "video":
                            continue
                        videos[k] = self.root / self._path(
                            "video_path",
                            video_key=k,
                            chunk_index=row[f"videos/{k}/chunk_index"],
                            file_index=row[f"videos/{k}/file_index"],
                        )
                        from_ts[k] = float(row[f"videos/{k}/from_timestamp"])
                        to_ts[k] = float(row[f"videos/{k}/to_timestamp"])
                except KeyError as err:
                    raise DatasetError(f, ep, f"episode row lacks {err}") from None
                out.append(EpisodeInfo(ep, int(row["length"]), data, videos, from_ts, to_ts, _scalars(row)))
        return sorted(out, key=lambda e: e.index)


# ---------------------------------------------------------------- helpers


def _rows(ranges: Ranges | None) -> np.ndarray | None:
    """The rows of half-open `ranges` [start, end), concatenated in order (None: the whole episode)."""
    if ranges is None:
        return None
    return np.concatenate([np.arange(start, end, dtype=np.int64) for start, end in ranges] or [np.zeros(0, np.int64)])


def _scalars(row: dict) -> dict:
    """The string, number and bool fields of a meta/episodes row (not its lists and statistics)."""
    return {k: v for k, v in row.items() if isinstance(v, str | int | float | bool)}


def _whole(value) -> int:
    """A non-negative whole number given as a JSON number (episode index, length); ValueError otherwise."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or value != int(value)
    ):
        raise ValueError(f"{value!r} is not a whole number")
    return int(value)


def _number(value, path: Path, field: str, kind: type) -> float | int:
    """`value` as a positive, finite `kind` (fps, chunks_size); DatasetError naming the file and field otherwise."""
    try:
        number = kind(value)
        if isinstance(value, bool) or not math.isfinite(number) or number <= 0 or (kind is int and number != value):
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise DatasetError(path, None, f"{field} {value!r} is not a positive {kind.__name__}") from None
    return number


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:  # Recursion: nested too deep
        raise DatasetError(path, None, f"unreadable JSON: {err}") from None
    if not isinstance(obj, dict):
        raise DatasetError(path, None, f"a JSON {type(obj).__name__}, not an object")
    return obj


def _read_jsonl(path: Path) -> list[dict]:
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:  # Recursion: nested too deep
        raise DatasetError(path, None, f"unreadable JSON lines: {err}") from None
    bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
    if bad is not None:
        raise DatasetError(path, None, f"line {bad + 1} is not a JSON object")
    return rows


def _read_parquet(path: Path, columns: list[str] | None, episode: int | None) -> pa.Table:
    try:
        return pq.read_table(path, columns=columns)
    except Exception as err:  # pyarrow raises several types for damaged files
        raise DatasetError(path, episode, f"unreadable parquet: {err}") from err


def _column_to_numpy(table: pa.Table, column: str, path: Path, episode: int) -> np.ndarray:
    chunked = table.column(column)
    if (
        pa.types.is_list(chunked.type)
        or pa.types.is_fixed_size_list(chunked.type)
        or pa.types.is_large_list(chunked.type)
    ):
        try:
            return np.stack(chunked.to_numpy(zero_copy_only=False))  # keeps the stored dtype (float32 / float64)
        except ValueError as err:
            raise DatasetError(path, episode, f"column {column!r} is not a fixed-width vector: {err}") from err
    return chunked.to_numpy()


def _image_bytes(cell) -> bytes:
    """LeRobot stores images as {'bytes': ..., 'path': ...} structs; tolerate bare bytes."""
    if isinstance(cell, dict):
        return cell.get("bytes") or b""
    return cell or b""
