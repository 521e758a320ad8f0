"""The sample schema of the manifest: written by the producer from what it built, checked on every read of a sample
(one decode path: the trainer's reader, the webdataset decoder, `preprocess check`), and the one source of the
widths the trainer gives its DiT."""

from typing import cast


from devtools.synthetic import SHAPES
from wampipe.shardformat.index import Window
from wampipe.shardformat.layout import ACTION, CLIP, LATENTS, STATE
from wampipe.shardformat.manifest import Manifest
from wampipe.train.data import SampleReader, ShardIndex


def test_the_producer_records_the_schema_of_what_it_built(small_shards, droid_shards):
    tiny = SHAPES["tiny"]
    assert Manifest.read(small_shards).schema == {
        ACTION: {"dtype": "float32", "shape": list(tiny.action)},
        CLIP: {"dtype": "bfloat16", "shape": list(tiny.clip)},
        LATENTS: {"dtype": "bfloat16", "shape": list(tiny.latents)},
        STATE: {"dtype": "float32", "shape": list(tiny.state)},
    }
    index = ShardIndex(droid_shards)  # a real build: its schema is each sample's meta.json record
    reader = SampleReader(index, None)  # pyright: ignore[reportArgumentType]  # raw() decodes no model input
    meta, _ = reader.raw(*cast(Window, index.windows[0]).variants[0])
    assert index.manifest.schema == {k: {"dtype": r["dtype"], "shape": r["shape"]} for k, r in meta["tensors"].items()}
