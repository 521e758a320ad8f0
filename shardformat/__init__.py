"""The shard format (docs/FORMAT.md): the one contract between the preprocessor and the trainer.

layout    every file and member name          files     durable writes and hashing
keys      sample keys and window names        members   a sample's tar members
schema    the sample schema, the DiT's widths shard     a shard's JSON, `read_sample` (every reader's decode)
manifest  version, sealed JSON, the manifest  text      the prompt embedding table
stats     q99 normalization and padding       wds       `webdataset_decoder` for webdataset / wids
embodiments  what a sample of each robot holds (windows, views, state/action keys, prompt templates)
"""

from wampipe.shardformat.manifest import FORMAT_VERSION, Manifest, ShardFormatError
from wampipe.shardformat.wds import webdataset_decoder

__all__ = ["FORMAT_VERSION", "Manifest", "ShardFormatError", "webdataset_decoder"]
