"""The recipes of configs/: one name means the same data shapes in both halves, `--config` layering (preset < file <
flags) in both CLIs, one-line errors, and a run directory's config.yaml that reproduces the run's losses exactly."""

import dataclasses
from pathlib import Path

import pytest
import tyro

from wampipe import configs
from devtools.synthetic import SHAPES, SUBKEY_DIMS, make_synthetic_shards
from wampipe.errors import UsageError
from wampipe.preprocess import shards as preprocess_shards
from wampipe.preprocess.__main__ import main as preprocess_main
from wampipe.preprocess.pipeline import VAE_OF_MODEL
from wampipe.shardformat.embodiments import get_embodiment
from wampipe.train.config import Config, parse_args, preset_config
from wampipe.train.main import main as train_main
from wampipe.train.dit.model import preset

VAE = {"wan2.2": (48, 16), "wan2.1": (16, 8)}  # latent channels, spatial stride (both: 4x in time)


@pytest.mark.parametrize("name", [n for n in configs.names() if n != "tiny"])  # tiny's DiT adapts to any shards
def test_a_recipe_means_the_same_shapes_to_preprocessing_synthetic_shards_and_the_dit(name):
    data, shapes, dit = configs.recipe(name)["preprocess"], SHAPES[name], preset(name)
    dataset = preprocess_shards.DATASETS[data["dataset"]]
    emb = get_embodiment(dataset.embodiment)
    model = data.get("model", dataset.model)
    channels, stride = VAE[VAE_OF_MODEL[model]]
    h, w = (side // stride for side in emb.preset(model).target_hw)
    k, horizon = emb.window.num_chunks, emb.window.action_horizon
    dims = SUBKEY_DIMS[emb.tag]
    assert (shapes.dataset, shapes.embodiment, shapes.model) == (data["dataset"], emb.tag, model)
    assert shapes.latents == (channels, 1 + (emb.window.num_frames - 1) // 4, h, w)
    assert shapes.state == (k, sum(dims["state"].values()))
    assert shapes.action == (k * horizon, sum(dims["action"].values()))
    assert (shapes.y is not None) == (VAE_OF_MODEL[model] == "wan2.1")
    assert (dit.in_dim, dit.out_dim) == (channels + (20 if shapes.y else 0), channels)
    assert dit.frame_seqlen == (h // 2) * (w // 2) and dit.num_action_per_block == horizon
    assert (dit.text_dim, (dit.image_len, dit.image_dim)) == (shapes.text_dim, shapes.clip)
    assert preset_config(name).model.name == name


def test_every_preset_survives_the_file_round_trip(tmp_path):
    for name in configs.names():
        cfg = preset_config(name)
        configs.write(tmp_path / f"{name}.yaml", {"train": configs.plain(cfg)}, name)
        assert configs.apply(Config(), configs.read(tmp_path / f"{name}.yaml")["train"], name) == cfg


LEGACY = """train:
  stop_after: 0
  data: {micro_batch_size: 0, variant: -1, text_column: ""}
  model: {num_layers: 0}
  optim: {warmup_steps: -1, fused: null}
  parallel: {global_batch_size: 0, ac_blocks: -1, peak_tflops: 0.0, reshard_after_forward: null}
  metrics: {val_batch: 0}
"""


def test_auto_is_the_one_spelling_of_not_set_and_the_old_numbers_still_read(tmp_path):
    def unset(cfg: Config) -> tuple:
        d, p = cfg.data, cfg.parallel
        return (
            (d.micro_batch_size, d.variant, d.text_column, cfg.model.num_layers, cfg.optim.warmup_steps),
            (cfg.optim.fused, p.global_batch_size, p.ac_blocks, p.peak_tflops, cfg.metrics.val_batch),
            (cfg.stop_after, p.reshard_after_forward),
        )

    auto = (("auto",) * 5, ("auto",) * 5, (None, None))
    old = tmp_path / "old" / "config.yaml"  # a run directory's, saved before auto was one word
    old.parent.mkdir()
    old.write_text(LEGACY)
    assert unset(parse_args(["--config", str(old), "--data.shards", "s"])) == auto
    flags = ["--data.micro-batch-size", "0", "--data.variant", "-1", "--model.num-layers", "0", "--stop-after", "0"]
    flags += ["--optim.warmup-steps", "-1", "--parallel.global-batch-size", "0", "--parallel.ac-blocks", "-1"]
    flags += ["--parallel.peak-tflops", "0", "--metrics.val-batch", "0", "--data.text-column", ""]
    cfg = parse_args(["--config", "libero-5b", "--data.shards", "s", *flags])
    assert unset(cfg)[:2] == auto[:2] and cfg.stop_after is None
    # a preset spells every on/off setting it leaves to the GPUs auto, and a saved config reads back the same
    assert "auto" in configs.path_of("libero-5b").read_text().split("reshard_after_forward:")[1].split(",")[0]
    assert preset_config("libero-5b").parallel.reshard_after_forward is None
    configs.write(tmp_path / "new.yaml", {"train": configs.plain(cfg)}, "new")
    saved = configs.read(tmp_path / "new.yaml")["train"]
    assert (saved["data"]["micro_batch_size"], saved["parallel"]["ac_blocks"], saved["optim"]["fused"]) == ("auto",) * 3
    assert parse_args(["--config", str(tmp_path / "new.yaml")]) == dataclasses.replace(
        cfg, config=str(tmp_path / "new.yaml")
    )


def test_flags_override_the_file_which_overrides_the_preset(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "# a partial config\ntrain:\n  preset: libero-5b\n  steps: 7\n  optim: {lr: 2e-5, betas: [0.9, 0.99]}\n"
    )
    cfg = parse_args(["--config", str(path), "--optim.lr", "3e-5", "--data.shards", "s"])
    want = preset_config("libero-5b")
    want = dataclasses.replace(
        want,
        config=str(path),
        steps=7,
        data=dataclasses.replace(want.data, shards="s"),
        optim=dataclasses.replace(want.optim, lr=3e-5, betas=(0.9, 0.99)),
    )
    assert cfg == want
    # --preset picks the base the file applies to
    tiny = parse_args(["--preset", "tiny", "--config", str(path), "--data.shards", "s"])
    assert (tiny.preset, tiny.steps, tiny.parallel.global_batch_size, tiny.optim.lr) == ("tiny", 7, "auto", 2e-5)
    # a recipe name is its file
    assert parse_args(["--config", "droid-14b", "--data.shards", "s"]) == dataclasses.replace(
        preset_config("droid-14b"),
        config="droid-14b",
        data=dataclasses.replace(preset_config("droid-14b").data, shards="s"),
    )


def test_preprocess_config_sets_the_defaults_of_its_flags(tmp_path):
    def parse(*argv):
        return tyro.cli(preprocess_shards.Args, default=preprocess_shards.defaults(list(argv)), args=list(argv))

    assert parse("--config", "tiny") == dataclasses.replace(
        parse("--dataset", "droid", "--anchor-stride", "4", "--samples-per-shard", "16"), config="tiny"
    )
    assert parse("--config", "droid-14b", "--anchor-stride", "2").model == "14b"
    assert parse("--config", "libero-5b", "--model", "14b").model == "14b"
    assert parse("--config", "libero-5b").dataset == "libero"


@pytest.mark.parametrize(
    "text, error",
    [
        ("train:\n  optim: {lr: 1e-5, moment: 2}\n", r"mine.yaml: train.optim: unknown key 'moment' \(known: "),
        ("train:\n  steps: many\n", r"mine.yaml: train.steps: 'many' is not of type int$"),
        ("train:\n  model: {name: 5b-libero}\n", r"mine.yaml: train.model.name: '5b-libero' is not one of \["),
        ("preprocess: {dataset: droid}\n", r"mine.yaml: no train section$"),
        ("train: [1, 2\n", r"mine.yaml: line 2: expected ',' or '\]', but got '<stream end>'$"),
    ],
)
def test_bad_trainer_files_stop_with_one_line(tmp_path, text, error):
    (tmp_path / "mine.yaml").write_text(text)
    with pytest.raises(UsageError, match=error):
        parse_args(["--config", str(tmp_path / "mine.yaml"), "--data.shards", "s"])


def test_unknown_names_stop_with_one_line():
    with pytest.raises(UsageError, match=r"^--config nope: no such file and no such recipe \(recipes: droid-14b, "):
        parse_args(["--config", "nope"])
    with pytest.raises(UsageError, match=r"^unknown DiT preset '14b'; choose one of"):
        preset("14b")
    with pytest.raises(SystemExit, match=r"^unknown recipe 'libero'; choose one of"):
        make_synthetic_shards(Path("unused"), "libero")


def test_both_clis_list_config_and_stop_with_one_line_for_a_bad_file(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("preprocess:\n  datset: droid\n")
    for main, command, error in [
        (preprocess_main, ["shards"], ": preprocess: unknown key 'datset' (known: "),
        (train_main, [], ": no train section"),
    ]:
        with pytest.raises(SystemExit) as helped:
            main([*command, "--help"])
        assert helped.value.code == 0 and "--config" in capsys.readouterr().out
        with pytest.raises(SystemExit) as failed:
            main([*command, "--config", str(tmp_path / "bad.yaml")])
        message = str(failed.value.code)
        assert message.startswith(str(tmp_path / "bad.yaml") + error) and "\n" not in message
