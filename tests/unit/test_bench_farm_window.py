"""Where scripts/bench_farm.py starts its steady-state window on a GPU utilization trace: at the ramp into the
first sustained work, after the start-up blips (CUDA start, weight loading, the compiled VAE's warm-up passes)."""

from scripts.bench_farm import BusySampler


def trace(*stretches: tuple[float, float]) -> BusySampler:
    """A two-GPU sampler holding `stretches` of (seconds, busy %), sampled every 0.2 s from t = 0."""
    sampler = BusySampler(["0", "1"])
    t = 0.0
    for seconds, pct in stretches:
        for _ in range(round(seconds / 0.2)):
            sampler.samples.append([pct, pct])
            sampler.times.append(round(t, 1))
            t += 0.2
    return sampler


def test_window_opens_at_the_ramp_into_sustained_work_not_at_warm_up_blips():
    # idle start-up; a 6 s warm-up at ~50 % (what four GPUs showed while compiling); idle; a ramp; steady work
    sampler = trace((20, 0), (6, 50), (10, 0), (1, 30), (60, 95), (5, 20))
    assert sampler.steady_start() == 36.0
    mean = sampler.mean_pct(36.0)
    assert mean is not None and mean > 85


def test_short_gaps_inside_the_ramp_do_not_move_the_window():
    sampler = trace((10, 0), (1, 60), (1, 0), (1, 60), (30, 95))
    assert sampler.steady_start() == 10.0  # a 1 s gap is not the idle stretch of a start-up


def test_no_sustained_work_no_window():
    assert trace((10, 0), (3, 100), (10, 0)).steady_start() is None
    assert BusySampler([]).steady_start() is None
