"""The presets' auto settings: recompute mode, micro-batch and resharding resolved from the GPUs (train/config.py)."""

import pytest

from wampipe.errors import UsageError
from wampipe.train.planning.auto import resolve_auto
from wampipe.train.config import ParallelConfig, parse_args, validate
from wampipe.train.dit.model import build_model
from wampipe.train.parallel import parallelize, reduce_dtype

H100, H200 = 79.2, 139.8  # GiB that torch reports for the 80 GB and 141 GB cards


def _cfg(tmp_path, *flags, preset="libero-5b"):
    return parse_args(["--preset", preset, "--data.shards", str(tmp_path), *flags])


def _parts(cfg):
    return cfg.parallel.activation_checkpoint, cfg.data.micro_batch_size, cfg.parallel.reshard_after_forward


@pytest.mark.parametrize(
    "preset, gib, gpus, want, stream, why",
    [
        # the measured settings, fastest first; more or larger GPUs only free memory. stream: (gradients reduced every
        # micro-batch, parameters gathered once per step)
        ("libero-5b", H100, 4, ("selective", 8, False), (True, True), "measured 15.01"),
        ("libero-5b", H100, 8, ("selective", 8, False), (True, True), "measured 15.01"),
        ("libero-5b", H200, 1, ("full", 8, False), (False, False), "measured 15.70"),
        ("libero-5b", H200, 2, ("selective", 16, False), (False, False), "measured 16.39"),
        # on the 141 GB cards a micro-batch of 16 with one fp32 reduce per step beats the H100s' bf16 stream
        ("libero-5b", H200, 4, ("selective", 16, False), (False, True), "measured 16.30-16.73"),
        ("libero-5b", H200, 8, ("selective", 16, False), (False, True), "measured 16.30-16.73"),
        ("droid-14b", H200, 4, ("full", 1, True), (False, False), "measured 0.238"),
        ("droid-5b", H100, 4, ("selective", 8, False), (True, True), "measured 14.13"),
        ("droid-5b", H200, 8, ("selective", 16, False), (False, True), "measured 15.54"),
        ("droid-5b", H200, 2, ("full", 32, True), (False, False), "measured 13.13"),
        # nothing measured fits: the recipe with full recompute, where the memory model says it fits
        (
            "libero-5b",
            H100,
            2,
            ("full", 32, True),
            (False, False),
            "nothing measured fits these GPUs: estimated to fit, ~69 GiB of 79",
        ),
        ("droid-5b", H100, 2, ("full", 32, True), (False, False), "nothing measured fits"),
        ("droid-14b", H100, 8, ("full", 1, True), (False, False), "~48 GiB of 79"),
        # CPU: today's behaviour, the recipe
        ("libero-5b", None, 1, ("full", 32, True), (False, False), "on CPU"),
        ("droid-14b", None, 2, ("full", 1, True), (False, False), "on CPU"),
    ],
)
def test_the_table_picks_the_fastest_measured_setting_that_fits(tmp_path, preset, gib, gpus, want, stream, why):
    cfg = _cfg(tmp_path, preset=preset)
    assert _parts(cfg) == ("auto", "auto", None)  # the presets leave all three to the GPUs
    resolved, line = resolve_auto(cfg, gib, gpus)
    assert line is not None
    assert _parts(resolved) == want
    assert why in line and line.startswith(f"auto settings for {preset} on ") and "\n" not in line
    assert resolved.parallel.global_batch_size == cfg.parallel.global_batch_size  # the recipe's global batch
    p = resolved.parallel
    assert (p.reduce_every_micro_batch, p.gather_once_per_step) == stream
    # bf16 runs recompute every block alike, but on one H200: full recompute on 2 blocks keeps it off the ceiling
    assert (p.ac_blocks, p.ac_others) == (
        (2, "selective") if (preset, gib, gpus) == ("libero-5b", H200, 1) else ("auto", "none")
    )
    assert ("gathered once per step" in line) == stream[1]
    assert ("reduced every micro-batch" in line) == stream[0]
    # bf16 gradient reduce-scatters only where measured with loss parity: the LIBERO 5B on >= 4 80 GB GPUs
    bf16_reduce = preset == "libero-5b" and gpus >= 4 and gib == H100
    assert p.reduce_dtype == ("bfloat16" if bf16_reduce else "float32")
    assert ("reduce-scattered in bf16" in line) == bf16_reduce
    validate(resolved)
    assert _parts(cfg) == ("auto", "auto", None)  # a copy, untouched
    assert (cfg.parallel.reduce_every_micro_batch, cfg.parallel.gather_once_per_step) == (None, None)


def test_a_given_reduce_dtype_is_kept_and_an_unresolved_auto_reduces_in_fp32(tmp_path):
    cfg, line = resolve_auto(_cfg(tmp_path, "--parallel.reduce-dtype", "float32"), H100, 4)
    assert line is not None
    assert cfg.parallel.reduce_dtype == "float32" and "reduce-scattered in bf16" not in line
    cfg, _ = resolve_auto(_cfg(tmp_path, "--parallel.reduce-dtype", "bfloat16"), H100, 1)
    assert cfg.parallel.reduce_dtype == "bfloat16"
    # nothing left to auto: resolve_auto changes nothing, and the FSDP policy reduces in fp32
    given = _cfg(
        tmp_path,
        "--parallel.activation-checkpoint",
        "full",
        "--data.micro-batch-size",
        "8",
        "--parallel.reshard-after-forward",
        "--parallel.reduce-every-micro-batch",
        "--parallel.no-gather-once-per-step",
    )
    cfg, line = resolve_auto(given, H100, 4)
    assert line is None and cfg.parallel.reduce_dtype == "auto" and reduce_dtype(cfg.parallel) == "float32"


def test_given_flags_win_part_by_part(tmp_path):
    cfg, line = resolve_auto(_cfg(tmp_path, "--data.micro-batch-size", "16"), H200, 1)
    assert line is not None
    assert _parts(cfg) == ("full", 16, False) and line.endswith("; given: micro-batch")
    cfg, line = resolve_auto(_cfg(tmp_path, "--parallel.reshard-after-forward"), H200, 1)
    assert line is not None
    assert _parts(cfg) == ("full", 8, True) and line.endswith("; given: resharding")
    cfg, _ = resolve_auto(
        _cfg(tmp_path, "--parallel.no-reshard-after-forward", "--parallel.activation-checkpoint", "full"), H200, 2
    )
    assert _parts(cfg) == ("full", 16, False)
    every = _cfg(
        tmp_path,
        "--parallel.activation-checkpoint",
        "none",
        "--data.micro-batch-size",
        "4",
        "--parallel.reshard-after-forward",
        "--parallel.no-reduce-every-micro-batch",
        "--parallel.no-gather-once-per-step",
        "--parallel.float8-all-gather",
        "--parallel.float8",
        "none",
    )
    assert resolve_auto(every, H200, 1) == (every, None)  # nothing auto: nothing to say
    # tiny keeps its explicit recipe; asking it for auto gives that recipe
    assert resolve_auto(_cfg(tmp_path, preset="tiny"), H200, 1)[1] is None
    cfg, line = resolve_auto(
        _cfg(tmp_path, "--parallel.activation-checkpoint", "auto", "--data.micro-batch-size", "auto", preset="tiny"),
        None,
        2,
    )
    assert line is not None
    assert _parts(cfg) == ("none", 2, True) and "no recompute, micro-batch 2" in line


def test_gathering_once_is_chosen_only_where_nothing_reshards_after_forward(tmp_path):
    # the 4-GPU entry gathers once per step; resharding after forward, given, would gather every micro-batch anyway
    cfg, line = resolve_auto(_cfg(tmp_path, "--parallel.reshard-after-forward"), H100, 4)
    assert line is not None
    assert _parts(cfg) == ("selective", 8, True) and line.endswith("; given: resharding")
    assert (cfg.parallel.reduce_every_micro_batch, cfg.parallel.gather_once_per_step) == (True, False)
    validate(cfg)
    # given, it is kept
    cfg, line = resolve_auto(_cfg(tmp_path, "--parallel.no-gather-once-per-step"), H100, 4)
    assert line is not None
    assert not cfg.parallel.gather_once_per_step and line.endswith("; given: gathering")


def test_an_auto_micro_batch_keeps_the_global_batch(tmp_path):
    # 16 x 4 GPUs does not divide 48: the largest micro-batch that does is 12 (one micro-batch a step)
    cfg, line = resolve_auto(_cfg(tmp_path, "--parallel.global-batch-size", "48"), H200, 4)
    assert line is not None
    assert _parts(cfg) == ("selective", 12, False) and "global batch 48" in line
    cfg, line = resolve_auto(_cfg(tmp_path, "--parallel.global-batch-size", "48"), H100, 4)
    assert line is not None
    assert _parts(cfg) == ("selective", 6, False) and "global batch 48" in line  # 8 x 4 does not: 6, accumulating 2
    # a given micro-batch is kept as given (the trainer names the mismatch)
    cfg, _ = resolve_auto(_cfg(tmp_path, "--parallel.global-batch-size", "48", "--data.micro-batch-size", "8"), H200, 4)
    assert cfg.data.micro_batch_size == 8


def test_unresolved_settings_are_refused_where_they_would_be_used(tmp_path):
    with pytest.raises(UsageError, match=r"--data.micro-batch-size -1 \(must be >= 1\)"):
        _cfg(tmp_path, "--data.micro-batch-size", "-1")
    for unresolved in (
        ParallelConfig(activation_checkpoint="auto"),
        ParallelConfig(reshard_after_forward=None),
        ParallelConfig(float8_all_gather=None),
    ):
        with pytest.raises(ValueError, match="resolve_auto"):
            parallelize(build_model("tiny"), unresolved)


@pytest.mark.parametrize("preset", ["libero-5b", "droid-5b"])
def test_float8_weights_are_gathered_in_float8_only_where_a_gather_crosses_a_link(tmp_path, preset):
    """auto: float8 all-gathers halve the bytes between GPUs; on one GPU only their eager casts are left."""
    fp8 = ("--parallel.float8", "tensorwise")
    for name in ("libero-5b", "droid-5b", "droid-14b"):  # the presets leave it to auto
        assert _cfg(tmp_path, *fp8, preset=name).parallel.float8_all_gather is None
    one, line = resolve_auto(_cfg(tmp_path, *fp8, preset=preset), H200, 1)
    assert one.parallel.float8_all_gather is False and "the float8 linears' weights gathered in bf16" in str(line)
    several, line = resolve_auto(_cfg(tmp_path, *fp8, preset=preset), H200, 4)
    assert several.parallel.float8_all_gather is True and "gathered in float8" in str(line)
    given, _ = resolve_auto(_cfg(tmp_path, *fp8, "--parallel.float8-all-gather", preset=preset), H200, 1)
    assert given.parallel.float8_all_gather is True
    bf16, line = resolve_auto(_cfg(tmp_path, preset=preset), H200, 1)  # resolved, but nothing to say without float8
    assert bf16.parallel.float8_all_gather is False and "gathered" not in str(line)


def test_a_setting_measured_on_one_gpu_with_float8_is_taken_there_alone(tmp_path):
    """libero-5b's float8 entry reduces and keeps the gathered weights every micro-batch: local copies on one GPU,
    traffic on several, where the bf16 entries measured there are taken instead."""
    fp8 = ("--parallel.float8", "tensorwise")
    # the fastest: micro-batch 16 with bf16 moments, taken by --optim.moments auto since fp32 ones would not fit it
    one, line = resolve_auto(_cfg(tmp_path, *fp8), H200, 1)
    p = one.parallel
    assert (p.activation_checkpoint, one.data.micro_batch_size, one.optim.moments) == ("selective", 16, "bf16")
    assert (p.reduce_every_micro_batch, p.gather_once_per_step) == (True, True) and "measured 19.68-20.15" in str(line)
    # fp32 moments given: the fastest setting measured with them
    one, line = resolve_auto(_cfg(tmp_path, *fp8, "--optim.moments", "fp32"), H200, 1)
    p = one.parallel
    assert (p.activation_checkpoint, p.ac_blocks, p.ac_others, one.data.micro_batch_size) == ("full", 2, "selective", 8)
    assert (p.reduce_every_micro_batch, p.gather_once_per_step) == (True, True) and "measured 17.84" in str(line)
    assert one.optim.moments == "fp32"
    bf16, line = resolve_auto(_cfg(tmp_path), H200, 1)  # without float8: the bf16 entry
    assert (bf16.parallel.reduce_every_micro_batch, bf16.parallel.gather_once_per_step) == (False, False)
    assert "measured 15.70" in str(line)
    two, line = resolve_auto(_cfg(tmp_path, *fp8), H200, 2)
    assert _parts(two) == ("selective", 16, False) and "measured 16.39" in str(line)


def _mix(cfg):
    p = cfg.parallel
    return p.activation_checkpoint, p.ac_blocks, p.ac_others, p.reduce_every_micro_batch, cfg.data.micro_batch_size


def test_float8_runs_take_the_settings_measured_with_float8_then_the_bf16_ones(tmp_path):
    fp8 = ("--parallel.float8", "tensorwise")
    # the 14B on 4 H200 with float8: the measured mix (28 selective blocks, gradients reduced every micro-batch)
    cfg, line = resolve_auto(_cfg(tmp_path, *fp8, preset="droid-14b"), H200, 4)
    assert line is not None
    assert _mix(cfg) == ("full", 12, "selective", True, 1) and cfg.parallel.float8 == "tensorwise"
    assert (
        "full recompute on 12 blocks (selective recompute on the others), micro-batch 1, reshard after forward, "
        "gradients reduced every micro-batch"
        in line
        and "measured 0.357" in line
    )
    # the same GPUs where float8 cannot run (these calls' default) keep the bf16 entry
    cfg, line = resolve_auto(_cfg(tmp_path, preset="droid-14b"), H200, 4)
    assert line is not None
    assert _mix(cfg) == ("full", "auto", "none", False, 1) and cfg.parallel.float8 == "none"
    assert "measured 0.238" in line
    # no float8 entry for libero-5b: its bf16 measurement (float8 took no more memory where both were measured)
    cfg, line = resolve_auto(_cfg(tmp_path, *fp8), H100, 4)
    assert line is not None
    assert _mix(cfg) == ("selective", "auto", "none", True, 8) and "measured 15.01" in line
    # the 14B on 4 H100, with or without float8, fits only with bf16 moments (measured without float8): refused
    # with fp32 ones
    cfg, line = resolve_auto(_cfg(tmp_path, *fp8, preset="droid-14b"), H100, 4)
    assert line is not None
    assert cfg.optim.moments == "bf16" and "measured 0.251" in line
    with pytest.raises(UsageError, match="droid-14b does not fit 4 GPUs of 79 GiB"):
        resolve_auto(_cfg(tmp_path, *fp8, "--optim.moments", "fp32", preset="droid-14b"), H100, 4)


def test_the_recompute_mix_and_gradient_reduction_given_are_kept(tmp_path):
    fp8 = ("--parallel.float8", "tensorwise")
    cfg, line = resolve_auto(
        _cfg(tmp_path, *fp8, "--parallel.ac-blocks", "30", "--parallel.ac-others", "selective", preset="droid-14b"),
        H200,
        4,
    )
    assert line is not None
    assert _mix(cfg) == ("full", 30, "selective", True, 1) and "on 30 blocks" in line
    cfg, line = resolve_auto(
        _cfg(tmp_path, *fp8, "--parallel.no-reduce-every-micro-batch", preset="droid-14b"), H200, 4
    )
    assert line is not None
    assert _mix(cfg) == ("full", 12, "selective", False, 1) and line.endswith("; given: gradient reduction")
    assert "gradients reduced" not in line
    # a given recompute mode keeps its own blocks; the gradient reduction still comes from the fastest fit
    cfg, line = resolve_auto(
        _cfg(tmp_path, *fp8, "--parallel.activation-checkpoint", "full", preset="droid-14b"), H200, 4
    )
    assert line is not None
    assert _mix(cfg) == ("full", "auto", "none", True, 1) and line.endswith("; given: recompute")


def test_host_offloaded_state_reduces_every_micro_batch_and_refuses_float8(tmp_path):
    # the 14B on 4 H100 fits only with its state in host memory: the measured offloaded setting, named when absent
    cfg, line = resolve_auto(_cfg(tmp_path, "--parallel.cpu-offload", preset="droid-14b"), H100, 4)
    assert line is not None
    assert _mix(cfg) == ("full", "auto", "none", True, 2) and cfg.parallel.reshard_after_forward is False
    assert "measured 0.13 samples/s/GPU at 59.9 GiB on 4 H100" in line
    fp32 = ("--optim.moments", "fp32")
    with pytest.raises(UsageError) as refusal:
        resolve_auto(_cfg(tmp_path, *fp32, preset="droid-14b"), H100, 4)
    assert "--parallel.cpu-offload (~22 GiB per GPU" in str(refusal.value)
    # ... but not to a float8 run, which cannot offload
    with pytest.raises(UsageError) as refusal:
        resolve_auto(_cfg(tmp_path, *fp32, "--parallel.float8", "tensorwise", preset="droid-14b"), H100, 4)
    assert "cpu-offload" not in str(refusal.value)
    # the offloaded setting is never chosen for a run without the offload, however large its GPUs
    cfg, _ = resolve_auto(_cfg(tmp_path, preset="droid-14b"), H200, 4)
    assert _mix(cfg) == ("full", "auto", "none", False, 1) and cfg.parallel.reshard_after_forward is True
    # offloaded where nothing offloaded was measured (2 GPUs): the recipe's recompute with the largest micro-batch
    # estimated to fit (each micro-batch copies every gradient to the host), gradients reduced every micro-batch
    # (an unsharded accumulation would sit on the GPU)
    cfg, line = resolve_auto(_cfg(tmp_path, "--parallel.cpu-offload", preset="droid-14b"), H100, 2)
    assert line is not None
    assert _mix(cfg) == ("full", "auto", "none", True, 4)
    assert "gradients reduced every micro-batch for --parallel.cpu-offload" in line
    # given, the reduction stays as given
    cfg, line = resolve_auto(
        _cfg(tmp_path, "--parallel.cpu-offload", "--parallel.no-reduce-every-micro-batch", preset="droid-14b"), H100, 4
    )
    assert line is not None
    assert cfg.parallel.reduce_every_micro_batch is False and "for --parallel.cpu-offload" not in line
    with pytest.raises(UsageError, match=r"--parallel.cpu-offload True \(must be off with --parallel.float8"):
        _cfg(tmp_path, "--parallel.cpu-offload", "--parallel.float8", "tensorwise", preset="droid-14b")


def test_gathering_once_per_step_needs_the_gathered_parameters_kept_after_forward(tmp_path):
    with pytest.raises(
        UsageError,
        match=r"--parallel.gather-once-per-step True \(must be used with "
        r"--parallel.no-reshard-after-forward, given or chosen by the auto settings",
    ):
        _cfg(tmp_path, "--parallel.gather-once-per-step", "--parallel.reshard-after-forward")
    # auto resharding: checked again once resolved (train/main.py), as here
    kept, _ = resolve_auto(_cfg(tmp_path, "--parallel.gather-once-per-step"), H100, 4)
    validate(kept)
    resharded, _ = resolve_auto(_cfg(tmp_path, "--parallel.gather-once-per-step", preset="droid-14b"), H200, 4)
    with pytest.raises(UsageError, match="gather-once-per-step"):
        validate(resharded)


def test_float8_auto_takes_the_float8_setting_where_it_is_the_fastest_measured_and_can_run(tmp_path):
    """The presets' --parallel.float8 auto: float8 where the fastest setting measured for these GPUs is a float8
    one and float8 matmuls run here; bf16 wherever it cannot run, trains adapters or offloads its state."""
    ready = {"float8_missing": None}  # torchao installed, a GPU of compute capability >= 8.9
    cfg, line = resolve_auto(_cfg(tmp_path), H200, 1, **ready)
    p = cfg.parallel
    assert (p.float8, p.activation_checkpoint, cfg.data.micro_batch_size, cfg.optim.moments) == (
        "tensorwise",
        "selective",
        16,
        "bf16",
    )
    assert "float8 tensorwise linears" in str(line) and "measured 19.68-20.15" in str(line)
    # the same card without torchao: the bf16 setting, and the line says what float8 needs
    cfg, line = resolve_auto(_cfg(tmp_path), H200, 1, float8_missing="needs torchao: pip install 'wampipe[fp8]'")
    assert cfg.parallel.float8 == "none" and "measured 15.70" in str(line)
    assert "bf16 linears (the faster float8 setting measured here needs torchao: pip install 'wampipe[fp8]')" in str(
        line
    )
    # the 14B on 4 H200: its float8 entry beats every bf16 one measured there
    cfg, line = resolve_auto(_cfg(tmp_path, preset="droid-14b"), H200, 4, **ready)
    assert cfg.parallel.float8 == "tensorwise" and "measured 0.357" in str(line)
    # where a bf16 setting is the fastest measured (two H200, the H100s) or nothing is measured: bf16
    for preset, gib, gpus, why in [
        ("libero-5b", H200, 2, "measured 16.39"),
        ("droid-14b", H100, 4, "measured 0.251"),
        ("droid-5b", H200, 1, ""),
    ]:
        cfg, line = resolve_auto(_cfg(tmp_path, preset=preset), gib, gpus, **ready)
        assert cfg.parallel.float8 == "none" and why in str(line) and "linears" not in str(line)
    # given flags win; adapters and host-offloaded state never take float8; a CPU run neither
    for flags, preset, gib, gpus in [
        (("--parallel.float8", "none"), "libero-5b", H200, 1),
        (("--lora.rank", "8"), "libero-5b", H200, 1),
        (("--parallel.cpu-offload",), "droid-14b", H200, 4),
    ]:
        cfg, line = resolve_auto(_cfg(tmp_path, *flags, preset=preset), gib, gpus, **ready)
        assert cfg.parallel.float8 == "none" and "linears" not in str(line)
    assert resolve_auto(_cfg(tmp_path), None, 1, **ready)[0].parallel.float8 == "none"
    # nothing else auto: float8 still resolved, and said
    given = ("--parallel.activation-checkpoint", "full", "--data.micro-batch-size", "8")
    given += ("--parallel.reshard-after-forward", "--parallel.no-reduce-every-micro-batch")
    given += ("--parallel.no-gather-once-per-step",)
    cfg, line = resolve_auto(_cfg(tmp_path, *given), H200, 1, **ready)
    assert cfg.parallel.float8 == "tensorwise" and line == "auto settings for libero-5b: float8 tensorwise linears"
    with pytest.raises(ValueError, match="resolve_auto"):
        parallelize(build_model("tiny"), ParallelConfig(float8="auto"))
