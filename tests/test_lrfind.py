"""`jzero tune lr` (`jzero.analysis.lrfind`): on a problem whose stable learning rates are known (SGD on
a quadratic: no progress far below 1 / h, divergence above 2 / h) the suggestion lies between
the flat region and the divergence point; the command writes the plot, the curve and a config
with the suggested lr; bad ranges are one line."""
import json

import jax
import numpy as np
import pytest

import jzero
from jzero.analysis import lrfind
from jzero.config import ConfigError

from helpers import jzero_cli

SMALL = ["--set", "jzero.model.d_model=32", "--set", "jzero.model.d_ff=64", "--set", "jzero.model.seq_len=16",
         "--set", "jzero.data.max_bytes=200000"]


@pytest.mark.parametrize("curvature", [0.1, 10.0, 1000.0])
def test_suggestion_lies_between_the_flat_region_and_divergence(curvature):
    """SGD on f(w) = h/2 |w|^2 from w = 1 (100 coordinates, one step per lr): the step
    multiplies w by (1 - lr h), so lr << 1/h barely moves the loss and lr > 2/h diverges."""
    lrs = lrfind.schedule(1e-6, 1e4, 100)
    w = np.ones(100)

    def step(i):
        nonlocal w
        loss = 0.5 * curvature * float(w @ w)
        w = w - lrs[i] * curvature * w
        return loss

    with np.errstate(over="ignore", invalid="ignore"):  # the divergence it must detect
        test = lrfind.run(step, lrs)
    assert 0.01 / curvature < test.suggestion < 2 / curvature
    assert test.diverged_at is not None and test.diverged_at > 2 / curvature


@pytest.mark.parametrize("low,high,steps,message", [
    (1.0, 0.1, 50, r"--min / --max: need 0 < min < max"),
    (0.0, 1.0, 50, r"--min / --max: need 0 < min < max"),
    (1e-6, 1.0, 3, r"--steps: the range test needs at least 5 steps"),
])
def test_bad_ranges_are_one_line(low, high, steps, message):
    with pytest.raises(ConfigError, match=message):
        lrfind.schedule(low, high, steps)


def test_divergence_too_early_is_one_line():
    with pytest.raises(ConfigError, match="diverged after 3 steps, too early"):
        lrfind.suggest([1e-3, 1e-2, 1e-1], [1.0, 0.9, 0.8])


def test_cli_writes_the_plot_the_curve_and_a_config_with_the_lr(tmp_path):
    proc = jzero_cli("tune", "lr", "configs/gpt_tiny.json", "--steps", "20", "--min", "1e-5", "--max", "1",
                     "--out", str(tmp_path), *SMALL)
    assert proc.returncode == 0, proc.stderr
    curve = json.loads((tmp_path / "lr_find.json").read_text())
    tuned = jzero.load_config(tmp_path / "tuned_lr.json", dp_size=2)
    assert tuned.optimizer.params["lr"] == pytest.approx(curve["suggestion"])
    assert tuned.scheduler.type == "WarmupLR" and curve["suggestion"] in curve["lrs"]
    assert (tmp_path / "lr_find.png").stat().st_size > 10_000 and "suggested lr" in proc.stdout
    assert jax.numpy.isfinite(curve["losses"][0])


SHRINK = {"d_model": 32, "d_ff": 64}


@pytest.mark.slow  # five compiles and sweeps: about a minute on 2 cores
@pytest.mark.parametrize("config,stage", [("gpt_tiny", 3), ("gpt_moe_tiny", 2), ("vit_digits", 1),
                                          ("clip_digits", 0), ("mlp_digits", 3)])
def test_range_test_sweeps_every_task_and_stage_to_breaking_point(config, stage):
    """The sweep reaches the optimizer at every stage and on every task: from a harmless lr to
    1e3, Adam's steps grow with the lr until the model breaks. A cross-entropy then diverges
    (the test stops early, the suggestion below the stop); CLIP's contrastive loss cannot pass
    log(batch), the loss of embeddings that no longer tell examples apart, and ends there."""
    raw = json.load(open(f"configs/{config}.json"))
    raw["zero_optimization"] = {"stage": stage}
    raw["jzero"]["model"].update(SHRINK if config != "mlp_digits" else {"d_model": 32})
    test = lrfind.range_test(raw, min_lr=1e-4, max_lr=1e3, steps=24)
    assert np.isfinite(test.losses[0]) and 1e-4 <= test.suggestion <= 1e3
    if config == "clip_digits":
        assert test.diverged_at is None
        np.testing.assert_allclose(test.losses[-1], np.log(raw["train_batch_size"]), rtol=1e-3)
        assert abs(test.losses[0] - np.log(raw["train_batch_size"])) > 0.1
    else:
        assert test.diverged_at is not None and test.suggestion < test.diverged_at < 1e3
        assert min(test.smoothed) < test.smoothed[0]


@pytest.mark.slow  # a range test and a short run: about 40 s
def test_train_auto_lr_runs_the_range_test_and_trains_with_its_choice(tmp_path):
    proc = jzero_cli("train", "configs/gpt_tiny.json", "--auto-lr", "12", "--out", str(tmp_path), "--steps", "4",
                     "--set", 'optimizer.params.lr="auto"', "--set", "jzero.train.eval_interval=2", *SMALL)
    assert proc.returncode == 0, proc.stderr
    assert "--auto-lr: the lr range test (12 steps" in proc.stdout


def test_auto_lr_on_a_set_lr_is_one_line():
    proc = jzero_cli("train", "configs/gpt_tiny.json", "--auto-lr")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert '--auto-lr: the config\'s optimizer.params.lr is 0.003, not "auto"' in proc.stderr


@pytest.mark.slow  # a whole `jzero train` process (the default suite's budget)
def test_an_auto_lr_without_auto_lr_takes_hf_trainers_default_and_says_so(tmp_path):
    """lr "auto" is what HF's templates say: without --auto-lr it is the Trainer's default,
    in the one line that lists the filled keys, which points to --auto-lr."""
    proc = jzero_cli("train", "configs/gpt_tiny.json", "--out", str(tmp_path), "--steps", "1",
                     "--set", 'optimizer.params.lr="auto"', *SMALL)
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if "HF Trainer defaults" in line]
    assert "optimizer.params.lr=5e-05" in line and "jzero train --auto-lr" in line
