"""The build spec (preprocess.spec) is the one list of a build's inputs: what inputs.json records, what each unit
records and what reruns compare all come from its fields' stages."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import pytest

from wampipe.preprocess.shards import Args
from wampipe.preprocess.spec import FINALIZE, UNIT, BuildSpec, arg

# The flags that change no output byte: where and how the run goes, not what it builds.
RUN_ONLY = {
    "config",
    "out",
    "staging_dir",
    "workers",
    "finalize_workers",
    "executor",
    "ray_address",
    "unit_index",
    "num_units",
    "stage",
    "fail_fast",
    "overwrite",
    "compile_cache",
    "official_filters",
}
# inputs.json's keys as builds before the spec recorded them: a build made then resumes now
RECORDED = {
    "src",
    "dataset",
    "model",
    "anchor_stride",
    "augment_variants",
    "seed",
    "compress",
    "decode_backend",
    "dtype",
    "image_features",
    "vae_compile",
    "batch_size",
    "episodes_per_unit",
    "max_episodes",
    "samples_per_shard",
    "val_episodes",
    "threads_per_worker",
    "device",
    "vae",
    "image_encoder",
    "text_encoder",
    "tokenizer",
    "metadata",
}
# the selection flags, recorded since filters exist: None while a filter is off, as a key older builds lack reads
SELECTION = {
    "keep_ranges",
    "keep_ranges_key",
    "drop_failed",
    "reward_field",
    "require_language",
    "episodes",
    "exclude_episodes",
    "min_length",
}


@pytest.fixture
def args(tmp_path) -> Args:
    """Completed arguments (as preprocess.shards.run makes them) over a tiny source and stand-in weight files."""
    (tmp_path / "src" / "meta").mkdir(parents=True)
    (tmp_path / "src" / "meta" / "info.json").write_text("{}")
    for name in ("vae", "image_encoder", "text_encoder", "tokenizer", "other", "metadata"):
        (tmp_path / name).write_text(name)
    return Args(
        src=tmp_path / "src",
        out=str(tmp_path / "out"),
        model="5b",
        dtype="float32",
        threads_per_worker=2,
        vae_compile="off",
        batch_size=4,
        **{name: tmp_path / name for name in ("vae", "image_encoder", "text_encoder", "tokenizer")},
    )


def spec_of(args: Args, **flags) -> BuildSpec:
    return BuildSpec.from_args(replace(args, **flags), embodiment="oxe_droid")


def test_every_argument_that_changes_bytes_is_recorded(args):
    staged = {f.name for f in fields(BuildSpec) if f.metadata["stage"]}
    assert {f.name for f in fields(Args)} - staged == RUN_ONLY
    inputs = spec_of(args).inputs()
    assert set(inputs) == staged == RECORDED | SELECTION
    assert {name: inputs[name] for name in SELECTION} == dict.fromkeys(SELECTION)
    filtered = spec_of(args, drop_failed=True, require_language="any", keep_ranges=args.vae).inputs()
    assert (filtered["drop_failed"], filtered["reward_field"], filtered["require_language"]) == (
        True,
        "next.reward",
        "any",
    )
    assert filtered["keep_ranges"] == inputs["vae"] and filtered["keep_ranges_key"] == "{episode_index}"
    assert inputs["device"] == "cpu" and spec_of(args, device="cuda:1").inputs()["device"] == "cuda"
    assert inputs["vae"] != inputs["image_encoder"] and len(inputs["vae"]) == 64  # the files' sha256, not their paths


def test_finalize_only_arguments_leave_the_units_alone(args):
    base, files = spec_of(args).inputs(), args.vae.parent
    others = {
        "samples_per_shard": 7,
        "val_episodes": "1",
        "text_encoder": files / "other",
        "tokenizer": files / "other",
        "metadata": files / "metadata",
    }
    assert {f.name for f in fields(BuildSpec) if f.metadata["stage"] == FINALIZE} == set(others)
    for name, value in others.items():
        changed = spec_of(args, **{name: value}).inputs()
        assert changed[name] != base[name]
        assert BuildSpec.unit_inputs(changed) == BuildSpec.unit_inputs(base), name
    assert BuildSpec.unit_inputs(spec_of(args, anchor_stride=3).inputs()) != BuildSpec.unit_inputs(base)


def test_seed_changes_the_units_only_with_augmentation(args):
    def unit_seed(augment_variants: int, seed: int):
        return BuildSpec.unit_inputs(spec_of(args, augment_variants=augment_variants, seed=seed).inputs()).get("seed")

    assert unit_seed(0, 1) is None and unit_seed(0, 2) is None  # without augmentation it only permutes the shards
    assert (unit_seed(2, 1), unit_seed(2, 2)) == (1, 2)


def test_a_field_given_a_stage_is_an_input_with_no_other_list_to_edit(args):
    @dataclass(frozen=True, kw_only=True)
    class Wider(BuildSpec):
        crop: int = arg(UNIT, default=5)
        palette: str = arg(FINALIZE, default="warm")
        where: str = arg(default="here")  # no stage: no byte depends on it

    inputs = Wider.from_args(args, embodiment="oxe_droid").inputs()
    assert (inputs["crop"], inputs["palette"]) == (5, "warm") and "where" not in inputs
    assert Wider.unit_inputs(inputs)["crop"] == 5 and "palette" not in Wider.unit_inputs(inputs)


def test_compile_cache_default_lives_in_the_users_cache_and_changes_no_input(args, monkeypatch, tmp_path):
    from wampipe.preprocess.shards import prepare_defaults

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert prepare_defaults(replace(args)).compile_cache == tmp_path / "xdg" / "wampipe" / "compile"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's own setting wins
    assert prepare_defaults(replace(args)).compile_cache == tmp_path / "mine"
    given = prepare_defaults(replace(args, compile_cache=tmp_path / "given")).compile_cache
    assert given == tmp_path / "given"
    # where the kernels are cached decides no byte: a build resumes with another cache
    assert spec_of(args, compile_cache=tmp_path / "a").inputs() == spec_of(args, compile_cache=tmp_path / "b").inputs()


def test_the_compiled_vae_is_the_default_on_a_gpu_and_eager_on_cpu(args):
    from wampipe.preprocess.shards import prepare_defaults

    def completed(**flags):
        done = prepare_defaults(replace(args, **flags))
        return done.dtype, done.vae_compile, spec_of(done).inputs()["vae_compile"]

    # the 5B's Wan2.2 encoder is recorded by its kernels (norms fused, channels-last), whose bits are not those of
    # the first compiled encoder; the 14B's Wan2.1 one runs those first kernels, recorded as before
    fused = "fused-norms-channels-last"
    assert completed(device="cuda", dtype="auto", vae_compile="auto") == ("bfloat16", "on", fused)
    assert completed(device="cuda:1", dtype="auto", vae_compile="off") == ("bfloat16", "off", False)  # eager: a flag
    assert completed(device="cpu", dtype="auto", vae_compile="auto") == ("float32", "off", False)
    assert completed(device="cpu", vae_compile="on") == ("float32", "on", fused)
    assert completed(device="cpu", vae_compile="on", model="14b") == ("float32", "on", True)
    assert completed(device="cpu", vae_compile="off", model="14b") == ("float32", "off", False)


def test_the_batch_size_default_follows_the_device_and_is_recorded_resolved(args):
    from wampipe.preprocess.shards import prepare_defaults

    def batch(**flags):
        done = prepare_defaults(replace(args, **{"batch_size": None, **flags}))
        assert spec_of(done).inputs()["batch_size"] == done.batch_size  # a number: a rerun compares it as such
        return done.batch_size

    # on a GPU the padded shape whose compiled latents were measured, per VAE
    assert batch(device="cuda", model="5b") == batch(device="cuda", model="5b-wan22") == 32
    assert batch(device="cuda:1", model="14b") == 16
    assert batch(device="cpu", model="5b") == batch(device="cpu", model="14b") == 4
    assert batch(device="cuda", model="5b", batch_size=8) == 8  # given: kept
