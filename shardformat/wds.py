"""Reading shards with the `webdataset` library (or `wids`): one function that turns a raw sample into tensors.
For example:

    import webdataset as wds
    from wampipe.shardformat import webdataset_decoder

    decode = webdataset_decoder("shards/droid")
    for sample in wds.WebDataset(urls, shardshuffle=False).map(decode): ...
    # or random access: wids.ShardListDataset("shards/droid/wids.json").add_transform(decode)
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from wampipe.shardformat.layout import SHARD_NAME
from wampipe.shardformat.manifest import Manifest, ShardFormatError, relative_path
from wampipe.shardformat.shard import ShardRecord, json_path, read_sample
from wampipe.shardformat.text import TextTable


def webdataset_decoder(root: Path | str) -> Callable[[dict], dict]:
    """A `map` function for samples of the shard directory `root`, as WebDataset or wids yield them.

    It checks the text table against the manifest's sha256 once, verifies every member against the shard's JSON
    (CRC-32), restores the tensors (bf16 as torch bf16, `.zst` members decompressed) and checks them against the
    manifest's schema (shardformat.shard.read_sample), and joins the umT5 embedding of each prompt column from the
    text table. Returns
    {"__key__", "__url__", "meta": meta.json, <tensor name>: tensor, "text": {column: bf16 [tokens, dim]}}.
    It pickles, so DataLoader workers of any start method can run it.
    """
    return _Decoder(Path(root))


class _Decoder:
    def __init__(self, root: Path):
        self.root = root
        manifest = Manifest.read(root)
        self.text, self.schema = TextTable(root, manifest.text_table).verify(), manifest.schema
        self.records: dict[str, dict] = {}  # shard name -> {key: SampleRecord}, read on first use

    def __call__(self, sample: dict) -> dict:
        url = sample.get("__url__") or sample.get("__shard__")  # WebDataset / wids name the shard differently
        key = sample["__key__"]
        if url is None:
            raise ShardFormatError(f"sample {key}: no __url__ or __shard__ names its shard")
        shard = self.root / relative_path(Path(str(url)).name, f"sample {key}", "__url__", SHARD_NAME)
        if shard.name not in self.records:
            self.records[shard.name] = {s.key: s for s in ShardRecord.read(json_path(shard)).samples}
        record = self.records[shard.name].get(key)
        if record is None:
            raise ShardFormatError(f"{shard}: sample {key}: not in the shard's JSON")
        # WebDataset gives bytes named by suffix (latents.npy), wids streams named with the dot (.latents.npy)
        members = {
            k.lstrip("."): v if isinstance(v, bytes) else v.read() for k, v in sample.items() if not k.startswith("__")
        }
        meta, tensors = read_sample(shard, key, members, self.schema, record)
        prompts = {column: self.text.get(pid) for column, pid in meta["prompt_ids"].items()}
        return {"__key__": key, "__url__": str(url), "meta": meta, **tensors, "text": prompts}
