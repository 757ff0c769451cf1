"""jzero against DeepSpeed itself. Each ``tests/golden/*.json`` was recorded by
``benchmarks/deepspeed_oracle.py``: DeepSpeed 0.19.8 on 2 CPU ranks (gloo) trained the config the
file holds, from jzero's initial weights (the config's seed) on the batches stored in the file.
jzero replays it on 2 devices, no torch needed: per-step loss within 1e-5 relative in fp32, the
lr (and OneCycle's beta1) within 1e-6 relative at every step from step 0, and the grad norm
DeepSpeed reports within 1e-5.

bf16 is compared within 2e-3: DeepSpeed keeps bf16 params and gradients (with an fp32 master
copy in the optimizer) and jzero keeps fp32 master params cast to bf16 at use, so the two run
the same bf16 matmuls on the same rounded weights but round some products and gradient
elements differently; one bf16 rounding is 2^-8 = 3.9e-3 of an element, and the loss averages
thousands of them (measured: at most 3e-4 over 40 steps).
"""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = sorted((ROOT / "tests" / "golden").glob("*.json"))
BF16_LOSS_RTOL = 2e-3


@pytest.fixture(scope="module")
def oracle():
    spec = importlib.util.spec_from_file_location("deepspeed_oracle", ROOT / "benchmarks" / "deepspeed_oracle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports neither torch nor deepspeed (only its worker does)
    return module


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_jzero_replays_deepspeed_step_for_step(path, oracle):
    golden = oracle.load_golden(path)
    ds = golden["deepspeed"]
    assert len(ds) >= 30
    jz = oracle.replay(golden["config"], golden["tokens"])
    bf16 = golden["config"].get("bf16", {}).get("enabled", False)
    for t, (ours, theirs) in enumerate(zip(jz, ds, strict=True)):
        assert ours["lr"] == pytest.approx(theirs["lr"], rel=1e-6, abs=1e-12), f"lr at step {t}"
        assert (ours["beta1"] is None) == (theirs["beta1"] is None), f"beta1 at step {t}"
        if theirs["beta1"] is not None:
            assert ours["beta1"] == pytest.approx(theirs["beta1"], rel=1e-6), f"beta1 at step {t}"
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=BF16_LOSS_RTOL if bf16 else 1e-5), \
            f"loss at step {t}"
        if not bf16:
            assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5), f"grad norm at step {t}"


def test_golden_files_cover_what_users_carry_over(oracle):
    """Every stage, every scheduler, accumulation 1/2/4, clipping on (explicit and DeepSpeed's
    default 1.0) and off, L2 Adam, weight decay and bf16 appear in some golden run."""
    configs = [oracle.load_golden(p)["config"] for p in GOLDEN]
    seen = {
        "stages": {c.get("zero_optimization", {}).get("stage", 0) for c in configs},
        "schedulers": {c["scheduler"]["type"] for c in configs if "scheduler" in c},
        "accum": {c.get("gradient_accumulation_steps", 1) for c in configs},
        "clipping": {"default" if "gradient_clipping" not in c else
                     ("off" if c["gradient_clipping"] == 0 else "explicit") for c in configs},
        "adam_l2": any(c["optimizer"]["params"].get("adam_w_mode") is False for c in configs),
        "weight_decay": any(c["optimizer"]["params"].get("weight_decay", 0) > 0 for c in configs),
        "bf16": any(c.get("bf16", {}).get("enabled") for c in configs),
        "one_cycle_momentum": any(c.get("scheduler", {}).get("type") == "OneCycle" and
                                  c["scheduler"]["params"].get("cycle_momentum", True) for c in configs),
    }
    assert seen == {"stages": {0, 1, 2, 3},
                    "schedulers": {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"},
                    "accum": {1, 2, 4}, "clipping": {"default", "off", "explicit"}, "adam_l2": True,
                    "weight_decay": True, "bf16": True, "one_cycle_momentum": True}
