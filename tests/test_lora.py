"""LoRA from the config (issue 51): the adapters train and nothing else, on jzero's GPT, a user's
Linen model and a Hugging Face Llama; ZeRO-3 on 8 devices equals one device and an independent
hand-written LoRA loop; the merged export and PEFT's loading of the adapters give the model's logits."""
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jzero
from jzero.analysis import profile
from jzero.config import ConfigError
from jzero.models import gpt, lora

from helpers import jzero_cli, token_batches

GPT = gpt.GPTConfig(seq_len=32, d_model=32, n_heads=4, d_ff=64)
LORA = {"r": 4, "alpha": 8, "target_modules": ["qkv", "fc"]}


def lora_config(stage, ndev, adapters=None, accum=1):
    return jzero.load_config({
        "train_batch_size": 16, "gradient_accumulation_steps": accum,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}, "gradient_clipping": 0.0,
        "jzero": {"lora": adapters or LORA}}, dp_size=ndev)


def train(init_fn, loss_fn, batches, stage, ndev, adapters=None, accum=1):
    cfg = lora_config(stage, ndev, adapters, accum)
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=jax.random.key(0),
                       mesh=jzero.make_mesh(cfg, devices=jax.devices()[:ndev]))
    start, losses = jax.device_get(state.params), []
    for batch in batches:
        state, metrics = jzero.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return start, state, np.array(losses)


def is_adapter(path):
    return jax.tree_util.keystr(path).endswith((f"['{lora.A}']", f"['{lora.B}']"))


def test_gpt_zero3_trains_only_the_adapters(devices):
    """ZeRO-3 on 8 devices with accumulation equals one device at stage 0; every base weight is
    bit-identical after training, every adapter moved; the compiled step's optimizer state is
    Adam's two moments of the adapters alone."""
    init_fn, loss_fn = gpt.make(GPT)
    batches = token_batches(1, 16, GPT.seq_len, GPT.vocab_size) * 4  # one batch again: its loss must fall
    start, state, losses = train(init_fn, loss_fn, batches, 3, 8, accum=2)
    _, one, losses_one = train(init_fn, loss_fn, batches, 0, 1)
    np.testing.assert_allclose(losses, losses_one, rtol=1e-5)
    assert losses[-1] < losses[0]
    end = jax.device_get(state.params)
    moved = jax.tree_util.tree_map_with_path(lambda p, a, b: (is_adapter(p), not np.array_equal(a, b)), start, end)
    flags = jax.tree.leaves(moved, is_leaf=lambda x: isinstance(x, tuple))
    assert sum(a for a, _ in flags) == 4 and all(adapter == changed for adapter, changed in flags)
    batch = batches[0]
    report = profile.memory(jzero.train_step.lower(state, batch).compile())
    adapters = sum(x.size * 4 for p, x in jax.tree_util.tree_flatten_with_path(end)[0] if is_adapter(p))
    assert 2 * adapters / 8 <= report.opt_state <= 2 * adapters / 8 + 64


class UserModel(nn.Module):
    """A user's Linen model, no scan_layers: attention-like names LoRA targets by regex."""

    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Dense(16, name="q_proj")(x))
        h = nn.tanh(nn.Dense(16, name="v_proj")(h)) + h
        return nn.Dense(4, name="head")(h)


def test_user_linen_model_equals_hand_written_lora(devices):
    """A Linen model of the user's: ZeRO-3 on 8 devices trains as a hand-written LoRA loop on one
    device (the base closed over, W + alpha/r x A @ B in the forward, optax on the adapters)."""
    init_fn, loss_fn = jzero.from_linen(UserModel(), jnp.zeros((1, 8)), lambda out, b: jnp.mean((out - b["y"]) ** 2),
                                        inputs=lambda b: b["x"])
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(16, 8)).astype(np.float32), "y": rng.normal(size=(16, 4)).astype(np.float32)}
               for _ in range(5)]
    adapters = {"r": 2, "alpha": 6, "target_modules": ["q_proj$", "v_proj$"]}
    start, _, losses = train(init_fn, loss_fn, batches, 3, 8, adapters)

    base = {k: {"kernel": v["kernel"], "bias": v["bias"]} for k, v in start.items()}
    trained = {k: {n: start[k][n] for n in (lora.A, lora.B)} for k in ("q_proj", "v_proj")}
    tx = optax.adamw(1e-2, weight_decay=0.0)
    opt = tx.init(trained)

    def by_hand(ab, batch):
        params = {k: dict(v) for k, v in base.items()}
        for k, m in ab.items():
            params[k]["kernel"] = base[k]["kernel"] + 3.0 * m[lora.A] @ m[lora.B]
        return loss_fn(params, batch, jax.random.key(0))

    want = []
    for batch in batches:
        value, grads = jax.value_and_grad(by_hand)(trained, batch)
        updates, opt = tx.update(grads, opt, trained)
        trained = optax.apply_updates(trained, updates)
        want.append(float(value))
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("section, message", [
    ({"r": 4, "target_modules": ["nothing_here"]}, r"jzero.lora.target_modules: \['nothing_here'\] matches no module"),
    ({"r": 4, "dropout": 0.1, "target_modules": ["qkv"]}, "jzero.lora.dropout: 0.1 is not supported"),
    ({"r": 0, "target_modules": ["qkv"]}, "jzero.lora.r: must be >= 1"),
    ({"r": 4}, "jzero.lora.target_modules: give regexes"),
])
def test_bad_lora_sections_are_named(section, message):
    init_fn, loss_fn = gpt.make(GPT)
    with pytest.raises(ConfigError, match=message):
        cfg = lora_config(0, 1, section)
        mesh = jzero.make_mesh(cfg, devices=jax.devices()[:1])
        jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=jax.random.key(0), mesh=mesh)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_lora_exports_merged_and_as_peft(tmp_path, kind):
    """Fine-tune a Hugging Face model's q/v projections (GPT-2: its fused c_attn) with LoRA at
    ZeRO-3 on chats, assistant turns only: the base weights in the checkpoint are bit-identical
    to the files'; `export --hf` loads in transformers with jzero's LoRA logits (rtol 1e-5);
    `export --peft` loads onto the transformers base with PEFT and gives them too (rtol 1e-4);
    `jzero eval` of the checkpoint, told nothing of LoRA, scores as the merged export does."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import dataclasses

    import hf_models
    from transformers import AutoModelForCausalLM

    from jzero.models import hfconfig, llama
    from jzero.runtime import hf
    from jzero.runtime.weights import read_params

    ref = hf_models.make(kind, tmp_path / "base")
    chats = [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}]}
             for t in hf_models.TEXTS * 4]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    targets = ["q_proj", "v_proj"] if kind == "llama" else ["qkv"]
    out = tmp_path / "run"
    run = jzero_cli("train", "configs/hf_finetune.json", "--hf", str(ref["dir"]), "--data", str(data), "--steps", "6",
                    "--out", str(out), "--set", "optimizer.params.lr=0.01", "--set", "scheduler=null",
                    "--set", f"jzero.lora={json.dumps({'r': 4, 'alpha': 8, 'target_modules': targets})}",
                    "--set", "jzero.train.eval_interval=6")
    assert run.returncode == 0, run.stderr[-3000:]
    params = read_params(out / "checkpoints")
    spec = hfconfig.from_dict(hfconfig.read(ref["dir"]))
    files = hf.lazy_params(ref["dir"], spec.name, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), lora.merged_all(params, 1.0)))
    jax.tree.map(lambda mine, lazy: np.testing.assert_array_equal(mine, lazy[...]),
                 lora.merged_all(params, 0.0), files, is_leaf=lambda x: isinstance(x, hf.Lazy))
    module = (llama.Llama if spec.name == "llama" else gpt.GPT)(dataclasses.replace(spec.model, loss_tile=0))
    tokens = ref["tokens"][:, :-1]
    mine = np.asarray(module.apply({"params": lora.merged_all(params, 2.0)}, tokens))
    assert not np.allclose(mine, ref["logits"], atol=1e-3)  # the adapters moved the model

    merged = tmp_path / "merged"
    assert jzero_cli("export", str(out / "checkpoints"), "--hf", str(merged)).returncode == 0
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(torch.tensor(tokens)).logits
    np.testing.assert_allclose(theirs.numpy(), mine, rtol=1e-5, atol=1e-5 * np.abs(mine).max())
    if kind == "llama":  # eval of the LoRA checkpoint, jzero.lora read from it, = eval of the merged export
        ways = (("--hf", str(ref["dir"]), "--checkpoint", str(out / "checkpoints")), ("--hf", str(merged)))
        scores = [json.loads(jzero_cli("eval", "configs/hf_finetune.json", *how, "--data", str(data), "--json")
                             .stdout)["loss"] for how in ways]
        np.testing.assert_allclose(scores[0], scores[1], rtol=1e-5)

    adapter = tmp_path / "adapter"
    run = jzero_cli("export", str(out / "checkpoints"), "--peft", str(adapter))
    assert run.returncode == 0, run.stderr[-2000:]
    base = AutoModelForCausalLM.from_pretrained(ref["dir"], dtype=torch.float32)
    with torch.no_grad():
        peft_logits = peft.PeftModel.from_pretrained(base, adapter).eval()(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(peft_logits, mine, rtol=1e-4, atol=1e-4 * np.abs(mine).max())
