"""`jzero tune batch` (`jzero.analysis.tune`): the largest micro-batch per device whose compiled peak fits
the budget, proven by the next size over it, found without allocating anything; the global
batch is kept; bad input is one line."""
import json

import jax
import numpy as np
import pytest

from jzero.analysis import tune

from helpers import jzero_cli

RAW = {"train_batch_size": 12, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
       "jzero": {"mesh": {"devices": 2}, "model": {"size": "tiny", "d_model": 32, "d_ff": 64, "seq_len": 16}}}


PEAKS = {}


@pytest.fixture
def shared_peaks(monkeypatch):
    """Every test compiles RAW: one compile per micro-batch size for the module (peak_at is pure)."""
    compile_peak = tune.peak_at
    monkeypatch.setattr(tune, "peak_at", lambda raw, m: PEAKS.setdefault(m, compile_peak(raw, m)))


def test_largest_micro_batch_fits_and_the_next_does_not(shared_peaks):
    live = len(jax.live_arrays())
    budget = (tune.peak_at(RAW, 3) + tune.peak_at(RAW, 4)) // 2  # 3 rows per device fit, 4 do not
    search = tune.largest_micro_batch(RAW, budget)
    assert search.largest == 3 and search.peaks[3] <= budget < search.peaks[4]
    assert len(jax.live_arrays()) == live  # compiled on abstract shapes: nothing allocated
    # the global batch (12 over 2 devices: 6 rows each) is kept: micro 3 x accumulation 2
    assert (search.train_batch_size, search.micro, search.accum) == (12, 3, 2)
    assert search.config(RAW)["train_micro_batch_size_per_gpu"] == 3


@pytest.mark.slow  # another compile (5 rows); the default suite's budget
def test_micro_batch_is_lowered_to_divide_the_global_batch(shared_peaks):
    budget = tune.peak_at(RAW, 4)  # 4 fits, 5 does not (peaks grow with the rows)
    search = tune.largest_micro_batch(RAW, budget)
    assert search.largest == 4 and (search.micro, search.accum) == (3, 2)  # 6 rows per device: 3 divides, 4 not


@pytest.mark.parametrize("args,message", [
    (["--memory-budget", "0"], "--memory-budget: must be > 0 GiB"),
    (["--memory-budget", "0.000001"], "--memory-budget: 0.000 GiB fits no micro-batch"),
])
def test_bad_budgets_are_one_line(tmp_path, args, message):
    config = tmp_path / "c.json"
    config.write_text(json.dumps(RAW))
    proc = jzero_cli("tune", "batch", str(config), "--time-top", "0", *args)
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("shape,peak,top", [
    ("affine", lambda m: 1000 + 37 * m, 3000),  # what compiled peaks look like: 4-5 compiles
    ("convex", lambda m: 1000 + m * m, 3000),
    ("stairs", lambda m: 1000 + 512 * -(-m // 8), 3000),
    ("flat then steep", lambda m: 1000 if m < 700 else 1000 + (m - 700) * 50, 3000),
])
def test_boundary_search_is_exact_for_any_growing_peak(shape, peak, top):
    """Against a brute-force scan, for 200 budgets; the next size is always probed (the proof)."""
    rng = np.random.default_rng(0)
    for budget in rng.integers(peak(1) - 50, peak(top), 200):
        calls = []
        got = tune.boundary(lambda m, calls=calls: calls.append(m) or peak(m), int(budget))
        assert got == max([m for m in range(1, top + 1) if peak(m) <= budget], default=0)
        assert got == 0 or got + 1 in calls
        assert len(calls) <= (5 if shape == "affine" else 2 * top.bit_length() + 2), (budget, calls)
