"""DeepSpeed itself as the reference: run one ds_config on DeepSpeed and on jzero from the same
initial weights and the same batches, and record DeepSpeed's trajectory as a golden file.

    pip install -e '.[oracle]'          # torch (CPU) + deepspeed, optional: only this script needs them
    python benchmarks/deepspeed_oracle.py --config tests/golden/configs/stage1_warmupdecay.json
    python benchmarks/deepspeed_oracle.py --all          # every config under tests/golden/configs

A config is a DeepSpeed ``ds_config.json`` with a ``jzero`` section for the model
(``jzero.model``: the reference GPT, small; ``jzero.mesh.devices`` is 2); ``oracle`` holds the
run's own settings (``steps``, default 40; ``data_seed``, default 0). The script

1. builds the GPT in jzero on 2 simulated devices and takes its initial params (seed = the
   config's ``seed``) and ``steps`` global batches of learnable token rows (numpy, ``data_seed``);
2. runs DeepSpeed with ``torchrun --nproc_per_node=2`` (gloo, CPU) on a torch GPT holding the same
   weights: rank r gets, for each micro-batch k, exactly the rows jzero puts on device r;
3. runs jzero on the same batches (`replay`, which the golden test calls too);
4. writes ``tests/golden/NAME.json`` (config, batches, DeepSpeed's per-step loss, lr, grad norm
   and beta1, the versions used) and prints the step-by-step comparison.

DeepSpeed's first run builds its CPU optimizer ops (a few minutes, cached under
``~/.cache/torch_extensions``). No network is needed.
"""
from __future__ import annotations

import argparse
import base64
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
FIELDS = ("loss", "lr", "grad_norm", "beta1")
RANKS = 2


# --------------------------------------------------------------------------------------------
# Shared by both sides: the data and the golden file's format (no jax, no torch).
# --------------------------------------------------------------------------------------------
def make_tokens(steps: int, batch: int, seq_len: int, vocab: int, seed: int) -> np.ndarray:
    """(steps, batch, seq_len + 1) uint8 token rows that count up from a random start with a
    random stride in 1..3 (mod vocab): learnable, so the loss moves and the trajectory has shape."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, vocab, (steps, batch, 1))
    stride = rng.integers(1, 4, (steps, batch, 1))
    return ((start + stride * np.arange(seq_len + 1)) % vocab).astype(np.uint8)


def encode_tokens(tokens: np.ndarray) -> dict:
    return {"shape": list(tokens.shape), "dtype": "uint8", "base64": base64.b64encode(tokens.tobytes()).decode()}


def decode_tokens(blob: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(blob["base64"]), np.dtype(blob["dtype"])).reshape(blob["shape"])


def load_golden(path: str | os.PathLike) -> dict:
    with open(path, encoding="utf-8") as f:
        golden = json.load(f)
    golden["tokens"] = decode_tokens(golden["tokens"])
    return golden


# --------------------------------------------------------------------------------------------
# jzero's side
# --------------------------------------------------------------------------------------------
def jzero_model(config: dict):
    """(resolved config, `jzero.models.Model`) for ``config``."""
    import jzero
    from jzero import models

    cfg = jzero.load_config({k: v for k, v in config.items() if k != "oracle"})
    return cfg, models.build(cfg)


def initial_state(config: dict):
    """jzero's initial TrainState for ``config`` (params from the config's seed) on its mesh."""
    import jax

    import jzero

    cfg, model = jzero_model(config)
    return jzero.init(model.init_fn, cfg, loss_fn=model.loss_fn, rng=jax.random.key(cfg.seed),
                      mesh=jzero.make_mesh(cfg))


def initial_params(config: dict) -> dict[str, np.ndarray]:
    """jzero's initial params for ``config`` as host arrays named like ``blocks.stacked.qkv.kernel``."""
    import jax

    from jzero.zero import treepath

    named = treepath.named_leaves(jax.device_get(initial_state(config).params))
    return {name.replace("/", "."): np.asarray(x, np.float32) for name, x in named.items()}


def replay(config: dict, tokens: np.ndarray) -> list[dict]:
    """jzero's per-step records (loss, lr, grad_norm, beta1 or None) for ``config`` on ``tokens``
    (steps, global batch, seq_len + 1), from the initial params of ``config['seed']``."""
    import jax

    import jzero

    state = initial_state(config)
    cfg = state.config
    cycles = cfg.scheduler is not None and cfg.scheduler.type.lower() == "onecycle"
    records = []
    for rows in tokens:
        rows = rows.astype(np.int32)
        state, metrics = jzero.train_step(state, {"inputs": rows[:, :-1], "targets": rows[:, 1:]})
        metrics = jax.device_get(metrics)
        hyper = state.opt_state.hyperparams  # the values this step applied
        records.append({"loss": float(metrics["loss"]), "lr": float(metrics["lr"]),
                        "grad_norm": float(metrics["grad_norm"]),
                        "beta1": float(hyper["b1"]) if cycles and "b1" in hyper else None})
    return records


# --------------------------------------------------------------------------------------------
# DeepSpeed's side (runs under torchrun; torch and deepspeed are imported only here)
# --------------------------------------------------------------------------------------------
def torch_gpt(params: dict[str, np.ndarray], model: dict):
    """The reference GPT in torch with jzero's parameter layout (stacked layers, (in, out)
    kernels), so jzero's arrays load unchanged: pre-LN, causal attention, tanh GELU, LayerNorm
    eps 1e-6 (Flax's), learned positions, tied embeddings."""
    import torch
    import torch.nn.functional as F

    heads = model["n_heads"]

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for name in sorted(params):  # direct params: ZeRO-3 gathers a module's own params
                weight = torch.nn.Parameter(torch.from_numpy(params[name].copy()))
                self.register_parameter(name.replace(".", "__"), weight)

        def p(self, name):
            return getattr(self, name.replace(".", "__"))

        def ln(self, x, prefix, i=None):
            scale, bias = self.p(prefix + ".scale"), self.p(prefix + ".bias")
            if i is not None:
                scale, bias = scale[i], bias[i]
            return F.layer_norm(x, x.shape[-1:], scale, bias, eps=1e-6)

        def forward(self, inputs, targets):
            b, t = inputs.shape
            wte = self.p("wte.embedding")
            x = wte[inputs] + self.p("wpe")[:t]
            d = x.shape[-1]
            hd = d // heads
            causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
            layer = "blocks.stacked."
            for i in range(self.p(layer + "qkv.kernel").shape[0]):
                h = self.ln(x, layer + "ln1", i)
                qkv = h @ self.p(layer + "qkv.kernel")[i].reshape(d, 3 * d)  # stored [d, 3, d]
                q, k, v = qkv.view(b, t, 3 * heads, hd).split(heads, dim=2)
                scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
                probs = torch.softmax(torch.where(causal, scores, torch.tensor(-1e30, dtype=scores.dtype)), -1)
                attn = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
                x = x + attn @ self.p(layer + "proj.kernel")[i] + self.p(layer + "proj.bias")[i]
                h = self.ln(x, layer + "ln2", i)
                h = F.gelu(h @ self.p(layer + "fc.kernel")[i] + self.p(layer + "fc.bias")[i], approximate="tanh")
                x = x + h @ self.p(layer + "out.kernel")[i] + self.p(layer + "out.bias")[i]
            logits = self.ln(x, "ln_f") @ wte.t()
            return F.cross_entropy(logits.float().reshape(b * t, -1), targets.reshape(-1))

    return GPT()


def deepspeed_worker(workdir: str) -> None:
    """One rank of the DeepSpeed run (under torchrun): trains on this rank's rows of every
    micro-batch and (rank 0) writes ``records.json``."""
    import deepspeed
    import torch
    import torch.distributed as dist

    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    arrays = np.load(os.path.join(workdir, "inputs.npz"))
    params = {k[len("param:"):]: arrays[k] for k in arrays.files if k.startswith("param:")}
    tokens = arrays["tokens"]
    ds_config = {k: v for k, v in config.items() if k not in ("jzero", "oracle")}
    model = torch_gpt(params, config["jzero"]["model_resolved"])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    rank, world = dist.get_rank(), dist.get_world_size()
    accum = engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    records = []
    for rows in tokens:
        rows = torch.from_numpy(rows.astype(np.int64))
        mine = rows[rank * accum * micro:(rank + 1) * accum * micro]  # jzero's device r rows
        lr, mom = engine.get_lr()[0], engine.get_mom()[0]
        losses = []
        for k in range(accum):
            mb = mine[k * micro:(k + 1) * micro]
            loss = engine(mb[:, :-1], mb[:, 1:])
            engine.backward(loss)
            if k == accum - 1:
                norm = _stage0_grad_norm(engine)
            engine.step()
            losses.append(loss.detach().float())
        mean = torch.stack(losses).mean()
        dist.all_reduce(mean)
        ds_norm = engine.get_global_grad_norm()
        norm = float(ds_norm) if ds_norm is not None else norm
        beta1 = float(mom[0]) if isinstance(mom, (tuple, list)) and config.get("scheduler", {}).get(
            "type", "").lower() == "onecycle" else None
        records.append({"loss": float(mean) / world, "lr": float(lr), "grad_norm": norm, "beta1": beta1})
    if rank == 0:
        with open(os.path.join(workdir, "records.json"), "w", encoding="utf-8") as f:
            json.dump(records, f)


def _stage0_grad_norm(engine) -> float | None:
    """DeepSpeed reports no grad norm at stage 0 without clipping; after the boundary backward
    the averaged gradient is in ``p.grad`` (bf16: in the optimizer's fp32 accumulators)."""
    import torch

    grads = [p.grad.float() for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return None
    return float(torch.sqrt(sum((g * g).sum() for g in grads)))


def run_deepspeed(config: dict, params: dict[str, np.ndarray], tokens: np.ndarray) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="jzero-oracle-") as workdir:
        with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
        np.savez(os.path.join(workdir, "inputs.npz"), tokens=tokens, **{f"param:{k}": v for k, v in params.items()})
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
               os.path.abspath(__file__), "--deepspeed-worker", workdir]
        subprocess.run(cmd, env=env, check=True)
        with open(os.path.join(workdir, "records.json"), encoding="utf-8") as f:
            return json.load(f)


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------
def relative(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return abs(a - b) / max(abs(b), 1e-30)


def comparison_table(name: str, jz: list[dict], ds: list[dict]) -> str:
    lines = [f"{name}: jzero vs DeepSpeed, per step (relative differences)",
             f"{'step':>4} {'ds loss':>10} {'jz loss':>10} {'loss rel':>9} {'ds lr':>11} {'lr rel':>8} "
             f"{'norm rel':>9} {'beta1 rel':>9}"]
    for t, (a, b) in enumerate(zip(jz, ds, strict=True)):
        cells = [relative(a[k], b[k]) for k in ("loss", "lr", "grad_norm", "beta1")]
        shown = ["-" if c is None else f"{c:.1e}" for c in cells]
        lines.append(f"{t:>4} {b['loss']:>10.6f} {a['loss']:>10.6f} {shown[0]:>9} {b['lr']:>11.4e} {shown[1]:>8} "
                     f"{shown[2]:>9} {shown[3]:>9}")
    worst = {k: max((relative(a[k], b[k]) or 0.0) for a, b in zip(jz, ds, strict=True)) for k in FIELDS}
    lines.append("max relative difference: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    return "\n".join(lines)


def record(config_path: Path, out: Path | None) -> dict:
    try:
        import deepspeed
        import torch
    except ImportError as e:
        raise SystemExit(f"deepspeed_oracle: {e.name} is not installed; see docs/deepspeed.md "
                         "for the install command") from None
    config = json.loads(config_path.read_text())
    mesh = config.setdefault("jzero", {}).setdefault("mesh", {})
    if mesh.setdefault("devices", RANKS) != RANKS:
        raise SystemExit(f"{config_path}: jzero.mesh.devices must be {RANKS} (DeepSpeed runs {RANKS} ranks)")
    cfg, built = jzero_model(config)
    model, seq_len = built.spec, built.spec.seq_len
    if model.positions != "learned" or not model.tie_embeddings or model.vocab_size > 256:
        raise SystemExit(f"{config_path}: the oracle's torch GPT has learned positions, tied embeddings and "
                         "a vocabulary of at most 256 tokens")
    settings = config.setdefault("oracle", {})
    steps, data_seed = settings.setdefault("steps", 40), settings.setdefault("data_seed", 0)
    tokens = make_tokens(steps, cfg.train_batch_size, seq_len, model.vocab_size, data_seed)
    params = initial_params(config)
    worker_config = {**config, "jzero": {**config["jzero"], "model_resolved": {"n_heads": model.n_heads}}}
    ds = run_deepspeed(worker_config, params, tokens)
    jz = replay(config, tokens)
    golden = {"name": config_path.stem, "config": config, "tokens": encode_tokens(tokens),
              "versions": {"deepspeed": deepspeed.__version__, "torch": torch.__version__.split("+")[0]},
              "deepspeed": ds}
    out = out or GOLDEN / f"{config_path.stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(golden, indent=1) + "\n")
    tmp.replace(out)
    print(comparison_table(config_path.stem, jz, ds))
    print(f"wrote {out}")
    return golden


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, action="append", default=[], help="oracle config (repeatable)")
    parser.add_argument("--all", action="store_true", help="every config under tests/golden/configs")
    parser.add_argument("--out", type=Path, help="golden file to write (one --config only)")
    parser.add_argument("--deepspeed-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.deepspeed_worker:
        deepspeed_worker(args.deepspeed_worker)
        return 0
    configs = args.config + (sorted((GOLDEN / "configs").glob("*.json")) if args.all else [])
    if not configs:
        parser.error("give --config FILE or --all")
    if args.out and len(configs) != 1:
        parser.error("--out needs exactly one --config")
    for path in configs:
        if not path.is_file():
            parser.error(f"--config: {path} not found")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for path in configs:
        record(path, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
