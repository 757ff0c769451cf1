"""DeepSpeed's own gates on fixed router logits, recorded as the golden file `tests/test_moe.py`
checks `jzero.models.gating` against (no torch needed there).

    pip install -e '.[oracle]'            # torch (CPU) + deepspeed
    python benchmarks/deepspeed_gating.py  # writes tests/golden/gating/deepspeed_gating.json

Each case runs ``deepspeed.moe.sharded_moe.top1gating`` / ``top2gating`` / ``topkgating`` on
logits drawn from a fixed seed (a skewed case routes most tokens to one expert, so tokens are
dropped), with the random choices off (``use_rts`` False, no second-expert sampling, no noise):
DeepSpeed's combine weights (S, E, C), l_aux and exp_counts are stored beside the logits.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "tests" / "golden" / "gating" / "deepspeed_gating.json"
# (name, k, tokens, experts, capacity_factor, min_capacity, drop_tokens, skew)
CASES = [("top1", 1, 16, 4, 1.0, 2, True, 0.0), ("top1_skewed", 1, 16, 4, 1.0, 2, True, 2.0),
         ("top1_nodrop", 1, 16, 4, 1.0, 2, False, 2.0), ("top1_min_capacity", 1, 16, 4, 0.25, 3, True, 1.0),
         ("top2", 2, 16, 4, 1.0, 2, True, 0.0), ("top2_skewed", 2, 16, 4, 0.5, 1, True, 2.0),
         ("top2_nodrop", 2, 16, 4, 0.5, 1, False, 2.0), ("top3_skewed", 3, 16, 6, 0.5, 1, True, 1.5),
         ("top1_odd", 1, 13, 3, 1.3, 1, True, 1.0)]


def logits(tokens: int, experts: int, skew: float, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(tokens, experts)).astype(np.float32)
    x[:, 0] += skew  # expert 0 is preferred by most tokens: over capacity
    return x


def run(case: tuple, seed: int) -> dict:
    import torch
    from deepspeed.moe import sharded_moe as sm

    name, k, tokens, experts, cf, min_cap, drop, skew = case
    x = logits(tokens, experts, skew, seed)
    t = torch.from_numpy(x.copy())
    if k == 1:
        l_aux, combine, _, counts = sm.top1gating(t, cf, min_cap, drop_tokens=drop, use_rts=False)
    elif k == 2:
        l_aux, combine, _, counts = sm.top2gating(t, cf, min_cap, drop_tokens=drop, top2_2nd_expert_sampling=False)
    else:
        l_aux, combine, _, counts = sm.topkgating(t, k, cf, min_cap, drop_tokens=drop)
    return {"name": name, "k": k, "capacity_factor": cf, "min_capacity": min_cap, "drop_tokens": drop,
            "logits": x.tolist(), "combine": combine.numpy().tolist(), "l_aux": float(l_aux),
            "exp_counts": counts.numpy().astype(int).tolist()}


def main() -> int:
    import deepspeed
    import torch
    import torch.distributed as dist

    # drop_tokens=False asks DeepSpeed's groups for the expert-parallel world size: one rank.
    store = tempfile.mktemp()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    cases = [run(case, seed) for seed, case in enumerate(CASES)]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"deepspeed": deepspeed.__version__, "torch": torch.__version__, "cases": cases}))
    for c in cases:
        print(f"{c['name']:>18}: l_aux {c['l_aux']:.6f}  counts {c['exp_counts']}  "
              f"capacity {np.asarray(c['combine']).shape[2]}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
