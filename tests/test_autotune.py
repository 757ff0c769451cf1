"""`jzero autotune` on 8 simulated devices: candidates over the memory budget are pruned from
their compiled memory without ever running, the winner is the fastest timed survivor, and the
config it writes trains."""
import jax
import numpy as np
import pytest

import jzero
from jzero.analysis import autotune
from jzero.models import gpt

RAW = {"train_batch_size": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "jzero": {"mesh": {"devices": 8},
                 "model": {"size": "tiny", "d_model": 32, "d_ff": 64, "seq_len": 16, "n_layers": 2}}}


def test_candidates_fix_the_global_batch():
    cands = autotune.candidates(RAW, 8, stages=(1,), remats=("full",))
    assert [(c.micro, c.accum) for c in cands] == [(1, 2), (2, 1)]  # micro x accum x 8 devices = 16
    with pytest.raises(jzero.ConfigError, match="train_batch_size: 16 is not a multiple of the 3 devices"):
        autotune.candidates(RAW, 3)


@pytest.mark.slow  # eight AOT compiles and four timed candidates: about a minute on 2 cores
def test_prunes_without_running_and_picks_the_fastest(monkeypatch):
    results = autotune.measure(RAW, 8, stages=(0, 3), remats=("full",))
    peaks = {r.candidate.stage: [] for r in results}
    for r in results:
        peaks[r.candidate.stage].append(r.peak_bytes)
    assert max(peaks[3]) < min(peaks[0])  # ZeRO-3 holds 1/8 of the state
    budget = (max(peaks[3]) + min(peaks[0])) // 2
    executed = []
    real = autotune.time_candidate

    def spy(raw, compiled, abstract, steps):
        executed.append(raw["zero_optimization"]["stage"])
        return real(raw, compiled, abstract, steps)

    monkeypatch.setattr(autotune, "time_candidate", spy)
    ranked = autotune.tune(RAW, results, budget, steps=2)
    pruned = [r for r in ranked if r.status == "pruned"]
    timed = [r for r in ranked if r.status == "timed"]
    assert {r.candidate.stage for r in pruned} == {0} and len(pruned) == 2
    assert executed == [3, 3]  # the pruned stage-0 candidates never ran
    assert all(r.why.startswith("over budget") for r in pruned)
    assert ranked[0] is max(timed, key=lambda r: r.tokens_per_s)

    best = jzero.load_config(ranked[0].candidate.config(RAW))
    init_fn, loss_fn = gpt.make(gpt.gpt_config(best.jzero.model, best.jzero.remat))
    state = jzero.init(init_fn, best, loss_fn=loss_fn, rng=0)
    tokens = np.zeros((16, 16), np.int32)
    state, metrics = jzero.train_step(state, {"inputs": tokens, "targets": tokens})
    assert np.isfinite(float(metrics["loss"])) and int(jax.device_get(state.step)) == 1
