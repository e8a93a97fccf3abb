"""Device and dtype choice: explicit names pass through; a draft's auto dtype follows the measured probe."""
import math

import pytest
import torch

import offload.devices as devices


def test_explicit_dtypes_pass_through_and_names_round_trip():
    cpu = torch.device("cpu")
    for name, dtype in devices.DTYPES.items():
        assert devices.choose_dtype(name, cpu) == devices.choose_draft_dtype(name, cpu) == dtype
        assert devices.dtype_name(dtype) == name
    assert devices.choose_dtype("auto", cpu) == torch.float32
    with pytest.raises(ValueError, match="dtype must be"):
        devices.choose_draft_dtype("int4", cpu)


@pytest.mark.parametrize("speedup, expected", [(2.3, torch.bfloat16), (1.05, torch.float32), (0.4, torch.float32)])
def test_draft_auto_dtype_on_cpu_follows_the_bf16_probe(monkeypatch, speedup, expected):
    monkeypatch.setattr(devices, "cpu_bf16_speedup", lambda: speedup)
    assert devices.choose_draft_dtype("auto", torch.device("cpu")) == expected


def test_bf16_probe_is_the_ratio_of_the_two_timings_measured_once(monkeypatch):
    """The probe divides fp32 time by bf16 time (not the reverse), over the same matrices, once per process."""
    timings = {torch.float32: 0.9, torch.bfloat16: 0.3}
    calls = []

    def fake_seconds(dtype):
        calls.append(dtype)
        return timings[dtype]

    monkeypatch.setattr(devices, "_matvec_seconds", fake_seconds)
    devices.cpu_bf16_speedup.cache_clear()
    try:
        assert devices.cpu_bf16_speedup() == pytest.approx(3.0)
        assert devices.cpu_bf16_speedup() == pytest.approx(3.0) and len(calls) == 2   # cached
    finally:
        devices.cpu_bf16_speedup.cache_clear()


def test_matvec_timing_is_the_best_round_of_real_work():
    seconds = devices._matvec_seconds(torch.float32, rounds=2)
    assert math.isfinite(seconds) and 0 < seconds < 5
