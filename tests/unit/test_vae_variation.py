"""The distances scripts/check_vae_variation.py reports: bf16 values counted in representable steps, whichever the
sign, and the RMS of a difference against that of the latents."""

import torch

from scripts.check_vae_variation import distance, distances, ordered_bf16, rel_error


def test_ordered_bf16_counts_representable_steps_across_zero():
    one = torch.tensor([1.0], dtype=torch.bfloat16)
    next_up = (one.view(torch.int16) + 1).view(torch.bfloat16)  # the bf16 number right above 1
    assert int(ordered_bf16(next_up) - ordered_bf16(one)) == 1
    assert int(ordered_bf16(torch.tensor([-0.0])) - ordered_bf16(torch.tensor([0.0]))) == 0
    tiny = torch.tensor([2.0**-133], dtype=torch.bfloat16)  # the smallest subnormal: one step from zero each side
    assert int(ordered_bf16(tiny) - ordered_bf16(-tiny)) == 2
    values = torch.linspace(-3, 3, 101).to(torch.bfloat16)
    assert torch.all(ordered_bf16(values)[1:] > ordered_bf16(values)[:-1])  # monotone: a difference is a distance


def test_distance_of_one_step_and_of_scaled_noise():
    a = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    same = distance(a, a)
    assert same["frac_differ"] == 0 and same["rel_rms"] == 0 and same["p99_ulps"] == 0
    stepped = (a.view(torch.int16) + 1).view(torch.bfloat16)  # every element one step away from zero
    one = distance(stepped, a)
    assert one["frac_differ"] == 1 and one["frac_over_1_ulp"] == 0 and one["p99_ulps"] == 1
    assert 0 < one["rel_rms"] < 2**-7  # one step is at most 2^-8 relative, 2^-7 counting the rounding of a
    far = distance((a.float() * 1.1).to(torch.bfloat16), a)
    assert abs(far["rel_rms"] - 0.1) < 0.01 and far["frac_over_1_ulp"] > 0.9


def test_distances_split_the_noise_and_smooth_halves():
    a = torch.zeros(4, 3, dtype=torch.bfloat16)
    b = a.clone()
    b[3] = 1  # a smooth clip differs, the noise half does not
    split = distances(b, a)
    assert split["noise"]["frac_differ"] == 0 and split["smooth"]["frac_differ"] == 0.5


def test_script_reports_every_pair_of_eager_batch_sizes_and_compares_saved_runs(tmp_path):
    """A CPU run of the script end to end (narrow VAE, no compile): the eager encoder in three batch sizes, each pair
    reported; two saved runs of the same machine compare as identical."""
    from scripts.check_vae_variation import main

    args = [
        "--device",
        "cpu",
        "--quick",
        "--recipes",
        "libero-5b",
        "--clips",
        "4",
        "--batch-sizes",
        "4",
        "1",
        "2",
        "--time-reps",
        "1",
    ]
    (row,) = main([*args, "--save", str(tmp_path / "a.pt")])
    main([*args, "--save", str(tmp_path / "b.pt")])
    assert row["eager_rerun_same_bits"] and set(row["clips_per_s"]) == {"eager_b4", "eager_b1", "eager_b2"}
    assert set(row["eager_pairs_rel_rms"]) == {"eager_b4_vs_eager_b1", "eager_b4_vs_eager_b2", "eager_b1_vs_eager_b2"}
    assert row["graph_same_bits_as_without"] == {}  # CUDA graphs only on CUDA
    # each batch size's error against the float32 copy: on a CPU the encoder is float32 too, so the batch cut alone
    assert set(row["error_vs_fp32"]) == {"eager_b4", "eager_b1", "eager_b2"}
    assert all(e[half] < 1e-5 for e in row["error_vs_fp32"].values() for half in ("noise", "smooth"))
    assert set(row["eager_error_vs_fp32"]) == {"noise", "smooth"}
    (same,) = main(["--compare", str(tmp_path / "a-libero-5b.pt"), str(tmp_path / "b-libero-5b.pt")])
    assert {name for name in same if name.startswith("eager_b")} == {"eager_b4", "eager_b1", "eager_b2"}
    assert all(
        same[name][half]["frac_differ"] == 0
        for name in ("eager_b4", "eager_b1", "eager_b2")
        for half in ("noise", "smooth")
    )


def test_error_against_the_float32_reference_is_relative_and_split_by_half():
    ref = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    off = torch.cat([ref[:2] * 1.01, ref[2:] * 0.98])  # the noise half 1 % too large, the smooth half 2 % too small
    error = rel_error(off, ref)
    assert abs(error["noise"] - 0.01) < 1e-5 and abs(error["smooth"] - 0.02) < 1e-5
    assert rel_error(ref, ref) == {"noise": 0.0, "smooth": 0.0}
