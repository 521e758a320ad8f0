"""The text table: umT5 output per unique prompt, shared by every sample that names the prompt's id.

    text/embeddings.safetensors   prompt id -> bf16 [tokens, dim], trimmed to the prompt's real token count
    text/prompts.json             prompt id -> {text, tokens}
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardformat.files import atomic_write_json, atomic_writer, sha256_file

TABLE = "text/embeddings.safetensors"
PROMPTS = "text/prompts.json"


def write_text_table(out: Path, prompts: dict[str, str], embeddings: dict) -> dict:
    """Write both files; returns the manifest's `text_table` entry. `embeddings` maps each id of `prompts` to its
    umT5 output, already trimmed to the prompt's length."""
    from safetensors.torch import save_file

    out = Path(out)
    (out / TABLE).parent.mkdir(parents=True, exist_ok=True)
    tensors = {i: embeddings[i].to(torch.bfloat16).cpu().contiguous() for i in sorted(prompts)}
    with atomic_writer(out / TABLE) as f:
        save_file(tensors, f.name)  # streams to the temporary file by name; the writer fsyncs and renames it
    atomic_write_json(out / PROMPTS, {i: {"text": prompts[i], "tokens": int(t.shape[0])} for i, t in tensors.items()})
    return {"file": TABLE, "prompts": PROMPTS, "count": len(tensors), "sha256": sha256_file(out / TABLE)}


class TextTable:
    """Read access to a shard directory's text table (opened lazily, once per process)."""

    def __init__(self, root: Path | str, entry: dict):
        self.table, self.prompts = Path(root) / entry["file"], Path(root) / entry["prompts"]
        self._file = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_file": None}  # an open handle does not pickle into loader workers

    def get(self, prompt_id: str) -> torch.Tensor:
        if self._file is None:
            from safetensors import safe_open

            self._file = safe_open(str(self.table), framework="pt")
        return self._file.get_tensor(prompt_id)

    @property
    def longest_prompt(self) -> int:
        """umT5 rows of the longest prompt."""
        return max(p["tokens"] for p in json.loads(self.prompts.read_text()).values())

    @property
    def dim(self) -> int:
        from safetensors import safe_open

        with safe_open(str(self.table), framework="pt") as f:
            return int(f.get_slice(next(iter(f.keys()))).get_shape()[-1])
