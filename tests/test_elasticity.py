"""DeepSpeed's elasticity (`jzero.config.elastic`, the ``elasticity`` section): the global batch, the
valid data-parallel sizes and the micro-batch equal DeepSpeed's ``compute_elastic_config`` (a
golden file recorded from it by ``benchmarks/deepspeed_elasticity.py``) and a brute-force
reading of its documented rule written here; an invalid device count is one line; another
device count keeps the global batch."""
import json
import math
from functools import reduce
from pathlib import Path

import pytest

import jzero
from jzero.config import ConfigError, elastic

GOLDEN = json.loads((Path(__file__).resolve().parent / "golden" / "elasticity" / "deepspeed_elasticity.json")
                    .read_text())["cases"]


def load(section, dp, **extra):
    return jzero.load_config({"elasticity": {"enabled": True, **section}, **extra}, dp_size=dp)


@pytest.mark.parametrize("case", GOLDEN, ids=[f"{i}-dp{c['world_size']}" for i, c in enumerate(GOLDEN)])
def test_equals_deepspeed(case):
    if "error" in case:
        with pytest.raises(ConfigError, match=rf"^elasticity: a data-parallel size of {case['world_size']} is not "
                                              r"valid for global batch \d+; valid sizes: [\d, ]+$"):
            load(case["section"], case["world_size"])
        return
    cfg = load(case["section"], case["world_size"])
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (case["batch"], case["micro"])
    assert cfg.train_batch_size == cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * \
        case["world_size"]


def brute_force_v01(micro, max_batch, lo, hi, prefer_larger):
    """The documented v0.1 rule, by brute force: bases = the micro sizes and their LCM, each
    scaled by the largest highly composite number keeping it <= max; the candidate with the most
    device counts n in [lo, hi] such that n divides batch / m for some micro size m dividing it."""
    hcn = [n for n in range(1, 720721) if n in elastic.HCN]
    candidates = set()
    for base in [*micro, reduce(math.lcm, micro)]:
        if base <= max_batch:
            candidates.add(base * max(h for h in hcn if h * base <= max_batch))
    def valid(batch):
        return [n for n in range(lo, hi + 1) if any(batch % m == 0 and (batch // m) % n == 0 for m in micro)]
    key = (lambda b: (len(valid(b)), b)) if prefer_larger else (lambda b: (len(valid(b)), -b))
    best = max(sorted(candidates), key=key)
    return best, valid(best)


SECTIONS = [([2, 4, 6], 2000, 1, 200, True), ([2, 4, 6], 2000, 1, 200, False), ([3, 5, 7], 1000, 2, 64, True),
            ([8], 512, 1, 64, True), ([1, 2, 4, 8], 64, 1, 16, True), ([12, 16], 10000, 8, 512, True),
            ([5, 48], 48, 1, 48, True), ([7, 9], 777, 1, 111, False), ([6, 10, 15], 4000, 4, 128, True),
            ([1], 97, 1, 97, True), ([4, 6], 1500, 3, 30, False)]


@pytest.mark.parametrize("micro,max_batch,lo,hi,prefer_larger", SECTIONS)
def test_v01_is_its_documented_rule(micro, max_batch, lo, hi, prefer_larger):
    assert elastic.v01(micro, max_batch, lo, hi, prefer_larger) == brute_force_v01(micro, max_batch, lo, hi,
                                                                                     prefer_larger)


def test_another_device_count_keeps_the_global_batch():
    section = {"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.1}
    two, eight = load(section, 2), load(section, 8)
    assert two.train_batch_size == eight.train_batch_size == two.for_dp(8).train_batch_size
    assert (eight.train_micro_batch_size_per_gpu, eight.gradient_accumulation_steps) == \
        (two.for_dp(8).train_micro_batch_size_per_gpu, two.for_dp(8).gradient_accumulation_steps)
    with pytest.raises(ConfigError, match="elasticity: a data-parallel size of 9 is not valid for global batch 1680"):
        two.for_dp(9)


@pytest.mark.parametrize("section,extra,message", [
    ({"micro_batch_sizes": [2, 4]}, {}, r"elasticity.max_train_batch_size: required when elasticity is enabled"),
    ({"max_train_batch_size": 100}, {}, r"elasticity.micro_batch_sizes: required"),
    ({"max_train_batch_size": 100, "micro_batch_sizes": [2, 0]}, {}, r"elasticity.micro_batch_sizes: must be a list"),
    ({"max_train_batch_size": 100, "micro_batch_sizes": 4}, {}, r"elasticity.micro_batch_sizes: expected a list"),
    ({"max_train_batch_size": 3, "micro_batch_sizes": [2, 4]}, {}, r"elasticity.max_train_batch_size: must be >="),
    ({"max_train_batch_size": 100, "micro_batch_sizes": [2], "version": 0.3}, {}, r"elasticity.version: must be 0.1"),
    ({"max_train_batch_size": 100, "micro_batch_sizes": [2], "min_gpus": 9, "max_gpus": 4}, {},
     r"elasticity.min_gpus: must be >= 1 and <= max_gpus"),
    ({"max_train_batch_size": 100, "micro_batch_sizes": [2]}, {"train_batch_size": 64},
     r"elasticity: sets train_batch_size.*ignore_non_elastic_batch_info"),
])
def test_bad_sections_are_one_line(section, extra, message):
    with pytest.raises(ConfigError, match=message) as err:
        load(section, 2, **extra)
    assert "\n" not in str(err.value)


def test_ignore_non_elastic_batch_info_lets_elasticity_win():
    cfg = load({"max_train_batch_size": 100, "micro_batch_sizes": [2, 4], "version": 0.1,
                "ignore_non_elastic_batch_info": True}, 2, train_batch_size=64)
    assert cfg.train_batch_size == 96
