"""The text table: umT5 output per unique prompt, shared by every sample that names the prompt's id.

    text/embeddings.safetensors   prompt id -> bf16 [tokens, dim], trimmed to the prompt's real token count
    text/prompts.json             prompt id -> {text, tokens}

The manifest records the table's sha256 (`write_text_table` returns it).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from wampipe.shardformat.files import atomic_write_json, atomic_writer, sha256_file, sha256_regular
from wampipe.shardformat.layout import MANIFEST, TEXT_PROMPTS, TEXT_TABLE
from wampipe.shardformat.manifest import SIDE_FILES, ShardFormatError, check_sha256, relative_path

if TYPE_CHECKING:  # imported where used: the CLIs' --help stays quick
    import torch


def write_text_table(out: Path, prompts: dict[str, str], embeddings: dict) -> dict:
    """Write both files; returns the manifest's `text_table` entry. `embeddings` maps each id of `prompts` to its
    umT5 output, already trimmed to the prompt's length."""
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    (out / TEXT_TABLE).parent.mkdir(parents=True, exist_ok=True)
    tensors = {i: embeddings[i].to(torch.bfloat16).cpu().contiguous() for i in sorted(prompts)}
    with atomic_writer(out / TEXT_TABLE) as f:
        save_file(tensors, f.name)  # streams to the temporary file by name; the writer fsyncs and renames it
    atomic_write_json(
        out / TEXT_PROMPTS, {i: {"text": prompts[i], "tokens": int(t.shape[0])} for i, t in tensors.items()}
    )
    return {"file": TEXT_TABLE, "prompts": TEXT_PROMPTS, "count": len(tensors), "sha256": sha256_file(out / TEXT_TABLE)}


class TextTable:
    """Read access to a shard directory's text table (opened lazily, once per process). The embeddings file is the
    one the manifest hashes: what the trainer needs of the table (rows, widths) is read from it, never from
    prompts.json."""

    def __init__(self, root: Path | str, entry: dict):
        names = [
            relative_path(entry[field], MANIFEST, f"{block}.{field}", pattern)
            for block, field, pattern in SIDE_FILES
            if block == "text_table"
        ]
        self.table, self.prompts = (Path(root) / name for name in names)
        self.sha256 = entry["sha256"]
        self._file = None

    def verify(self) -> TextTable:
        """Check the embeddings file against the manifest's sha256 (ShardFormatError naming it otherwise)."""
        check_sha256(self.table, sha256_regular(self.table), self.sha256)
        return self

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_file": None}  # an open handle does not pickle into loader workers

    def get(self, prompt_id: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        if self._file is None:
            self._file = safe_open(str(self.table), framework="pt")
        try:
            return self._file.get_tensor(prompt_id)
        except (SafetensorError, TypeError) as err:  # an id a sample's meta.json names, but the table lacks
            raise ShardFormatError(f"{self.table}: prompt id {prompt_id!r}: {err}") from None

    @property
    def longest_prompt(self) -> int:
        """umT5 rows of the longest prompt."""
        from safetensors import safe_open

        with safe_open(str(self.table), framework="pt") as f:
            return max(f.get_slice(k).get_shape()[0] for k in f.keys())

    @property
    def dim(self) -> int:
        from safetensors import safe_open

        with safe_open(str(self.table), framework="pt") as f:
            return int(f.get_slice(next(iter(f.keys()))).get_shape()[-1])
