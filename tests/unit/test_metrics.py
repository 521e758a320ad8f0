"""The profiler's device-idle analysis on a Chrome trace in torch.profiler's export format."""

import pytest

from wampipe.train.metrics import device_idle, format_device_idle


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 0}


def test_device_idle_finds_gaps_and_the_host_work_behind_them():
    events = [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python"}},
        _x("kernel", "gemm", 0, 100),
        _x("gpu_memcpy", "Memcpy HtoD", 50, 60),  # overlaps the gemm: no gap
        _x("kernel", "adamw", 3110, 40),  # 3000 us gap after 110
        _x("kernel", "gelu", 3155, 5),  # 5 us launch gap
        _x("cpu_op", "train_step", 0, 4000),  # covers everything: not the innermost
        _x("cpu_op", "aten::empty", 100, 3005),  # innermost op covering the long gap
        _x("cuda_runtime", "cudaFree", 105, 2500),
        _x("cuda_runtime", "cudaLaunchKernel", 3105, 4),
    ]
    r = device_idle(events)
    assert r["span_ms"] == 3.16 and r["idle_ms"] == 3.005 and abs(r["busy_ms"] - 0.155) < 1e-12
    assert r["gaps"] == 2
    assert r["idle_ms_by_gap"] == {"under 10 us": 0.005, "10 us - 1 ms": 0.0, "1 ms and over": 3.0}
    first = r["longest"][0]
    assert (first["ms"], first["at_ms"], first["before"]) == (3.0, 0.11, "adamw")
    assert first["host_op"] == "aten::empty" and first["runtime"] == ["cudaFree 2.5 ms"]
    text = format_device_idle(r)
    assert "busy 0.2 of 3.2 ms" in text and "host: aten::empty (cudaFree 2.5 ms)" in text


def test_device_idle_of_a_cpu_trace_says_so():
    assert device_idle([_x("cpu_op", "aten::mm", 0, 10)]) == {}
    assert format_device_idle({}) == "device idle: no device events in the trace"


def test_idle_is_summed_by_the_op_the_launching_thread_was_in():
    def launch(name, ts, dur, corr, tid):
        kernel = _x("kernel", name, ts, dur) | {"args": {"correlation": corr}}
        return [kernel, _x("cuda_runtime", "cudaLaunchKernel", ts - 5, 2) | {"args": {"correlation": corr}, "tid": tid}]

    events = [
        *launch("gemm", 0, 100, 1, 1),
        *launch("add", 150, 10, 2, 1),  # 50 us gap: thread 1 in aten::add's launch
        *launch("norm", 200, 10, 3, 2),  # 40 us gap: thread 2 in the clip's norm
        *launch("mul", 215, 10, 4, 1),  # 5 us gap: launch latency, not counted
        *launch("mul", 250, 10, 5, 1),  # 25 us gap: thread 1 in aten::add again
        _x("cpu_op", "step", 0, 400) | {"tid": 1},
        _x("cpu_op", "aten::add", 101, 60) | {"tid": 1},
        _x("cpu_op", "aten::add", 226, 30) | {"tid": 1},
        _x("cpu_op", "clip_grad_norm", 150, 60) | {"tid": 2},
        _x("cpu_op", "aten::copy_", 150, 60) | {"tid": 3},  # another thread's op over the gap: not the launcher
    ]
    r = device_idle(events)
    assert r["idle_ms_by_host_op"] == [("aten::add", pytest.approx(0.075), 2), ("clip_grad_norm", 0.04, 1)]
    assert "0.04 ms in      1 gaps: clip_grad_norm" in format_device_idle(r)
