"""Config loading: DeepSpeed's batch rule, key validation with suggestions, unsupported
features, "auto", and each LR scheduler against DeepSpeed's formulas (written out here
independently of jzero/zero/schedules.py)."""
import json
import math

import jax
import jax.numpy as jnp
import pytest

import jzero
from jzero import models
from jzero.config import ConfigError, ConfigWarning
from jzero.zero import optim, schedules

from helpers import ROOT


def base(**kw):
    cfg = {"train_batch_size": 16}
    cfg.update(kw)
    return cfg


# (config, dp size, expected (train, micro, accum)) -- DeepSpeed's batch rule.
GOOD_BATCH = [
    ({"train_batch_size": 16}, 8, (16, 2, 1)),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}, 8, (64, 2, 4)),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 4}, 8, (64, 2, 4)),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 8, (48, 3, 2)),
    ({"train_micro_batch_size_per_gpu": 3}, 2, (6, 3, 1)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}, 1,
     (32, 4, 8)),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 8,
     (32, 2, 2)),
    ({"train_batch_size": 5e1, "train_micro_batch_size_per_gpu": 25}, 2, (50, 25, 1)),
]


@pytest.mark.parametrize("raw,dp,want", GOOD_BATCH)
def test_batch_rule(raw, dp, want):
    cfg = jzero.load_config(raw, dp_size=dp)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == want


def test_batch_rule_reresolves_for_another_mesh():
    cfg = jzero.load_config({"train_batch_size": 32, "gradient_accumulation_steps": 4}, dp_size=8)
    two = cfg.for_dp(2)
    assert (two.train_micro_batch_size_per_gpu, two.gradient_accumulation_steps, two.dp_size) == (4, 4, 2)


# (config, dp, pattern the one-line error must contain)
BAD = [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8}, 8,
     r"train_batch_size: 16 != .* 1 x gradient_accumulation_steps 8 x data-parallel size 8 \(= 64\)"),
    ({"train_batch_size": 12}, 8, r"train_batch_size: 12 is not a multiple of .*data-parallel size 8"),
    ({"train_batch_size": 20, "train_micro_batch_size_per_gpu": 3}, 2, r"not a multiple of train_micro"),
    ({"gradient_accumulation_steps": 2}, 8, r"set train_batch_size or train_micro_batch_size_per_gpu"),
    ({"train_batch_size": "auto"}, 8, r"set train_batch_size or train_micro"),
    (base(train_batch_sise=3), 8, r"train_batch_sise: unknown key; did you mean 'train_batch_size'\?"),
    (base(zero_optimization={"stgae": 2}), 8, r"zero_optimization.stgae: unknown key; did you mean 'stage'"),
    (base(zero_optimization={"stage": 4}), 8, r"zero_optimization.stage: 4 is not one of 0, 1, 2, 3"),
    (base(zero_optimization={"stage": "2"}), 8, r"zero_optimization.stage: '2' is not one of"),
    (base(bf16={"enabled": "yes"}), 8, r"bf16.enabled: expected true or false, got 'yes'"),
    (base(steps_per_print="10"), 8, r"steps_per_print: expected an integer, got str"),
    (base(gradient_clipping=-1), 8, r"gradient_clipping: must be >= 0"),
    ({"train_batch_size": 16, "optimizer": {"type": "Adamm"}}, 8,
     r"optimizer.type: unknown optimizer 'Adamm'; did you mean 'Adam'"),
    (base(optimizer={"type": "AdamW", "params": {"learning_rate": 1e-3}}), 8,
     r"optimizer.params.learning_rate: unknown key for AdamW"),
    (base(optimizer={"type": "adam", "params": {"betas": [0.9]}}), 8, r"optimizer.params.betas: expected \[beta1"),
    (base(optimizer={"type": "adam", "params": {"lr": "auto"}}, jzero={"auto": "strict"}), 8,
     r"jzero.auto: strict, and these keys are 'auto', .*: optimizer.params.lr; set each"),
    (base(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "cycle": "auto"}}), 8,
     r"scheduler.params.cycle: unknown key"),
    (base(optimizer={"type": "adam", "params": {"bias_correction": False}}), 8,
     r"optimizer.params.bias_correction: False is not supported"),
    (base(scheduler={"type": "WarmupCosine"}), 8, r"scheduler.type: unknown scheduler 'WarmupCosine'; did you mean"),
    (base(scheduler={"type": "WarmupDecayLR", "params": {}}), 8,
     r"scheduler.params.total_num_steps: required by WarmupDecayLR"),
    (base(scheduler={"type": "WarmupLR", "params": {"warmup_type": "cosine"}}), 8,
     r"scheduler.params.warmup_type: 'cosine' is not one of 'log', 'linear'"),
    (base(scheduler={"type": "OneCycle", "params": {"cycle_min_lr": "auto", "cycle_max_lr": 1e-3,
                                                    "cycle_first_step_size": 10}}), 8,
     r"scheduler.params.cycle_min_lr: 'auto' has no source"),
    (base(pipeline={"stages": 2, "partition": "best"}), 8, r"pipeline.partition: 'best' is not one of parameters"),
    (base(moe={"num_experts": 4, "k": 5}), 8, r"moe.k: must be in 1..num_experts \(4\), got 5"),
    (base(moe={"num_experts": 6, "ep_size": 4}), 8, r"moe.ep_size: 4 does not divide num_experts 6"),
    (base(moe={"capacity_factor": 0}), 8, r"moe.capacity_factor: must be > 0, got 0"),
    (base(moe={"eval_capacity_factor": -1.0}), 8, r"moe.eval_capacity_factor: must be > 0"),
    (base(moe={"k": 2, "noisy_gate_policy": "RSample"}), 8, r"moe.noisy_gate_policy: RSample applies to k = 1"),
    (base(moe={"noisy_gate_policy": "Gumbel"}), 8, r"moe.noisy_gate_policy: 'Gumbel' is not one of 'Jitter'"),
    (base(moe={"expert_interval": 3}), 8, r"moe.expert_interval: 3 does not divide jzero.model.n_layers 2"),
    (base(moe={"num_expert": 4}), 8, r"moe.num_expert: unknown key; did you mean 'num_experts'"),
    (base(moe={}, jzero={"model": {"name": "vit"}}), 8, r"moe: only the gpt reference model has MoE layers"),
    (base(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}), 8,
     r"zero_optimization.offload_param.device: NVMe offload is not supported; use 'cpu'"),
    (base(zero_optimization={"stage": 1, "offload_optimizer": {"device": "disk"}}), 8,
     r"zero_optimization.offload_optimizer.device: 'disk' is not one of 'none', 'cpu', 'nvme'"),
    (base(zero_optimization={"zero_quantized_weights": True}), 8,
     r"zero_optimization.zero_quantized_weights: quantizes stage 3's weight all-gathers; needs stage 3 \(got stage 0"),
    (base(zero_optimization={"zero_quantized_gradients": True}), 8,
     r"zero_optimization.zero_quantized_gradients: quantizes the gradient reduce-scatter of stages 1-3"),
    (base(jzero={"quantization_block_size": 0}), 8, r"jzero.quantization_block_size: must be >= 1, got 0"),
    (base(bf16={"enabled": True}, fp16={"enabled": True}), 8, r"bf16.enabled and fp16.enabled: choose one"),
    (base(fp16={"loss_scale_window": 0}), 8, r"fp16.loss_scale_window: must be >= 1"),
    (base(gradient_clipping="auto", bf16={"enabled": "auto"}, jzero={"auto": "strict"}), 8,
     r"these keys are 'auto', .*: gradient_clipping, bf16.enabled; set each"),
    (base(jzero={"remat": "dot"}), 8, r"jzero.remat: unknown policy 'dot'; did you mean 'dots'"),
    (base(jzero={"model": {"size": "huge"}}), 8, r"jzero.model.size: unknown size 'huge'"),
    (base(jzero={"model": {"n_heads": 5}}), 8, r"jzero.model.n_heads: 5 does not divide d_model 64"),
    (base(jzero={"mesh": {"devices": 0}}), 8, r"jzero.mesh.devices: must be >= 1"),
    (base(zero_optimization=[2]), 8, r"zero_optimization: expected an object, got list"),
]


@pytest.mark.parametrize("raw,dp,pattern", BAD, ids=[p.split(":")[0][:40] for _, _, p in BAD])
def test_bad_config_raises_one_line_error(raw, dp, pattern):
    with pytest.raises(ConfigError, match=pattern) as err:
        jzero.load_config(raw, dp_size=dp)
    assert "\n" not in str(err.value)


def test_full_deepspeed_config_loads_and_warns_about_noops(tmp_path):
    ds = {
        "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 5, "seed": 7,
        "gradient_clipping": 1.0, "wall_clock_breakdown": False,
        "optimizer": {"type": "Adam", "params": {"lr": 2e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                 "weight_decay": 0.1, "torch_adam": False}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": "auto", "total_num_steps": "auto",
                                                          "warmup_num_steps": 10}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto",
                              "stage3_gather_16bit_weights_on_model_save": True},
        "flops_profiler": {"enabled": False},
        "jzero": {"model": {"size": "tiny"}, "train": {"steps": 500}},
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    with pytest.warns(ConfigWarning, match="flops_profiler"):
        cfg = jzero.load_config(path, dp_size=8)
    assert cfg.gradient_accumulation_steps == 2 and cfg.seed == 7 and cfg.bf16.enabled
    model = models.build(cfg)
    zero = jzero.abstract_init(model.init_fn, cfg, loss_fn=model.loss_fn).config.zero_optimization
    h = 64  # the trained model's hidden size (the tiny GPT's) resolves the zero "auto" keys (HF's rules)
    assert zero.reduce_bucket_size == h * h
    assert zero.stage3_prefetch_bucket_size == int(0.9 * h * h)
    assert zero.stage3_param_persistence_threshold == 10 * h
    sched = schedules.build(cfg, 2e-4)
    # auto: max <- lr, T <- steps. Probe inside the decay (at the warmup's end the factor is 1 for any T):
    # optimizer step 201 applies get_lr(200) = max * (T - 200) / (T - W).
    assert float(sched.lr(201)) == pytest.approx(2e-4 * (500 - 200) / (500 - 10), rel=1e-6)
    assert cfg.to_dict()["optimizer"]["params"]["lr"] == 2e-4


def test_auto_zero_sizes_come_from_the_users_own_model():
    """A plain-function model with hidden size 48 gets its own sizes, not a reference preset's."""
    def init_fn(rng):
        k1, k2 = jax.random.split(rng)
        return {"w1": jax.random.normal(k1, (16, 48)), "b1": jnp.zeros(48), "w2": jax.random.normal(k2, (48, 8))}

    def loss_fn(params, batch, rng):
        return jnp.mean((jnp.tanh(batch["x"] @ params["w1"] + params["b1"]) @ params["w2"]) ** 2)

    cfg = jzero.load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}}, dp_size=8)
    assert cfg.zero_optimization.stage3_param_persistence_threshold == "auto"  # unknown until the model is
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=0)
    assert state.config.zero_optimization.reduce_bucket_size == 48 * 48
    assert state.config.zero_optimization.stage3_param_persistence_threshold == 480
    assert state.plan.params["b1"].spec == jax.sharding.PartitionSpec()  # 48 < 480 elements: kept whole


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.json"):
        jzero.load_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{\"train_batch_size\": 8,}")
    with pytest.raises(ConfigError, match=r"bad.json: invalid JSON at line 1"):
        jzero.load_config(bad)


# ---------------------------------------------------------------------------------------------
# Schedulers: DeepSpeed's formulas, t = number of scheduler steps taken (last_batch_iteration).
# ---------------------------------------------------------------------------------------------
def ds_warmup_gamma(t, w, kind):
    w = max(2, w)
    return (math.log(t + 1) / math.log(w) if kind == "log" else t / w) if t < w else None


def ds_warmup_lr(t, lo=0.0, hi=1e-3, w=1000, kind="log"):
    g = ds_warmup_gamma(t, w, kind)
    return lo + (hi - lo) * (1.0 if g is None else g)


def ds_warmup_decay_lr(t, total, lo=0.0, hi=1e-3, w=1000, kind="log"):
    g = ds_warmup_gamma(t, w, kind)
    if g is None:
        g = max(0.0, (total - t) / max(1.0, total - max(2, w)))
    return lo + (hi - lo) * g


def ds_warmup_cosine_lr(t, base_lr, total, wmin=0.0, w=1000, cmin=1e-4, kind="log"):
    g = ds_warmup_gamma(t, w, kind)
    if g is not None:
        return base_lr * (wmin + g * (1 - wmin))
    progress = min(1.0, (t - max(2, w) + 1) / max(1, total - max(2, w)))
    return base_lr * max(0.0, cmin + (1 - cmin) * (1 + math.cos(math.pi * progress)) / 2)


def ds_one_cycle_lr(t, lo, hi, first, second=None, decay_rate=0.0, decay_steps=0):
    second = first if second is None else second
    total = first + second
    if t < total:
        it = t + 1
        x = 1.0 + it / total - math.floor(1 + it / total)
        ratio = first / total
        s = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
        return lo + (hi - lo) * s
    if decay_steps == 0 or decay_rate == 0:
        return lo
    return lo / (1 + decay_rate * (t - total + 1) / decay_steps)


def ds_lr_range_test(t, lo=1e-3, size=2000, rate=1.0, staircase=False):
    interval = (t + 1) / size
    return lo * (1 + rate * (math.floor(interval) if staircase else interval))


W, T, BASE = 100, 400, 3e-4
# (type, params, get_lr formula, the value DeepSpeed's constructor writes into the optimizer)
SCHEDULES = [
    ("WarmupLR", {"warmup_num_steps": W}, lambda t: ds_warmup_lr(t, hi=BASE, w=W), 0.0),
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": W, "warmup_type": "linear"},
     lambda t: ds_warmup_lr(t, 1e-5, 1e-3, W, "linear"), 1e-5),
    ("WarmupDecayLR", {"total_num_steps": T, "warmup_num_steps": W},
     lambda t: ds_warmup_decay_lr(t, T, w=W), 0.0),
    ("WarmupDecayLR", {"total_num_steps": T, "warmup_num_steps": W, "warmup_type": "linear", "warmup_min_lr": 1e-4},
     lambda t: ds_warmup_decay_lr(t, T, lo=1e-4, w=W, kind="linear"), 1e-4),
    ("WarmupCosineLR", {"total_num_steps": T, "warmup_num_steps": W},
     lambda t: ds_warmup_cosine_lr(t, BASE, T, w=W), 0.0),
    ("WarmupCosineLR", {"total_num_steps": T, "warmup_num_steps": W, "warmup_min_ratio": 0.1,
                        "cos_min_ratio": 0.05, "warmup_type": "linear"},
     lambda t: ds_warmup_cosine_lr(t, BASE, T, 0.1, W, 0.05, "linear"), 0.0),  # 0, not 0.1 x base
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": W},
     lambda t: ds_one_cycle_lr(t, 1e-4, 1e-3, W), 1e-4),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": W,
                  "cycle_second_step_size": 2 * W, "decay_lr_rate": 0.5, "decay_step_size": 10},
     lambda t: ds_one_cycle_lr(t, 1e-4, 1e-3, W, 2 * W, 0.5, 10), 1e-4),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": W},
     lambda t: ds_lr_range_test(t, 1e-4, W), 1e-4),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": W, "lr_range_test_step_rate": 3.0,
                     "lr_range_test_staircase": True},
     lambda t: ds_lr_range_test(t, 1e-4, W, 3.0, True), 1e-4),
]


@pytest.mark.parametrize("name,params,formula,initial", SCHEDULES,
                         ids=[f"{n}-{i}" for i, (n, *_) in enumerate(SCHEDULES)])
def test_each_step_applies_the_value_deepspeed_applies(name, params, formula, initial):
    """DeepSpeed steps its scheduler after each optimizer step: step 0 runs with the constructor's
    value, step t with get_lr() at t-1 (measured against DeepSpeed itself: tests/golden)."""
    cfg = jzero.load_config({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": BASE}},
                             "scheduler": {"type": name, "params": params}}, dp_size=8)
    lr = schedules.build(cfg, BASE).lr
    assert float(lr(0)) == pytest.approx(initial, rel=1e-6, abs=1e-12)
    for t in (1, 2, W // 2, W - 1, W, W + 1, W + 2, (W + T) // 2, T - 1, T, T + 1, T + 50):
        assert float(lr(t)) == pytest.approx(formula(t - 1), rel=1e-5, abs=1e-12), t
    # Negative control: one step ahead (formula(t) at step t) is told apart where the lr moves.
    assert float(lr(W - 1)) != pytest.approx(formula(W - 1), rel=1e-3)


def test_one_cycle_cycles_beta1_inversely_one_step_behind():
    cfg = jzero.load_config({"train_batch_size": 8, "scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 10, "cycle_min_mom": 0.85}}},
        dp_size=8)
    sched = schedules.build(cfg, 1e-3)
    assert float(sched.momentum(0)) == pytest.approx(0.85)  # the constructor's cycle_min_mom
    assert float(sched.momentum(1)) == pytest.approx(0.9 - 0.05 / 10, abs=1e-6)  # formula(0): one step up
    assert float(sched.momentum(10)) == pytest.approx(0.85) and float(sched.lr(10)) == pytest.approx(1e-3)
    assert float(sched.momentum(20)) == pytest.approx(0.9, abs=1e-6)


def test_one_cycle_leaves_momentum_of_optimizers_without_betas_alone():
    """DeepSpeed disables cycle_momentum for torch SGD (no betas) with a warning; so does jzero."""
    cfg = jzero.load_config({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"momentum": 0.5}},
                             "scheduler": {"type": "OneCycle", "params": {
                                 "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 10}}},
                            dp_size=8)
    with pytest.warns(ConfigWarning, match="cycle_momentum: SGD has no betas"):
        opt = optim.build(cfg)
    assert opt.schedules.momentum is None
    state = opt.tx.init({"w": jnp.zeros(3)})
    assert float(state.hyperparams["momentum"]) == 0.5


HF_TEMPLATES = ["hf_zero2.json", "hf_zero3.json", "hf_zero3_offload.json"]


@pytest.mark.parametrize("name", HF_TEMPLATES)
def test_hf_templates_fill_the_trainers_auto_keys_in_one_warning(name):
    """Every "auto" HF's Trainer fills gets the Trainer's default, said in one warning; the
    keys jzero has a source for stay "auto" for their own rules; strict refuses them all."""
    path = ROOT / "configs" / name
    with pytest.warns(ConfigWarning) as caught:
        cfg = jzero.load_config(path, dp_size=8)
    (line,) = [str(w.message) for w in caught if "HF Trainer defaults" in str(w.message)]
    for key in ("optimizer.params.lr=5e-05", "optimizer.params.betas=[0.9, 0.999]", "optimizer.params.eps=1e-08",
                "optimizer.params.weight_decay=0.0", "scheduler.params.warmup_num_steps=0", "gradient_clipping=1.0",
                "fp16.enabled=False", "bf16.enabled=False", "gradient_accumulation_steps=1"):
        assert key in line
    assert "train_micro_batch_size_per_gpu" not in line  # derived from the given train_batch_size
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (32, 4, 1)
    assert cfg.optimizer.params["lr"] == 5e-5 and cfg.scheduler.params["warmup_max_lr"] == 5e-5
    raw = json.loads(path.read_text())
    raw["jzero"]["auto"] = "strict"
    with pytest.raises(ConfigError, match=r"jzero.auto: strict, .*: optimizer.params.lr, optimizer.params.betas, "
                                          r"optimizer.params.eps, optimizer.params.weight_decay, .*bf16.enabled"):
        jzero.load_config(raw, dp_size=8)
