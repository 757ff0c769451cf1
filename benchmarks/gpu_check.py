"""Every GPU claim jzero makes, checked and timed in one call on a lent GPU machine.

    python benchmarks/gpu_check.py --out $OUT            # the device tool's output folder
    python benchmarks/gpu_check.py --out /tmp/x --smoke  # the same rows, tiny, on CPU (a dry run)

Each row is one claim. A row that fails is recorded with its error and the next one runs; the
JSON and markdown (``gpu_check.{json,md}``, plus ``fused_adamw.{json,md}`` from its row) are
rewritten after every row, so a window cut short keeps what it measured. Rows:

- ``platform``: device kind, count, memory, jax version;
- ``fused_adamw``: the Pallas AdamW step vs optax.adamw vs a device copy (`fused_adamw.py`);
- ``train``: `jzero train configs/gpt_small_zero2.json` on one device in bf16: tokens/s, MFU
  against the known peak, compile time, that the loss falls;
- ``xla_flags``: the same run with ``overlap_comm`` and bucket sizes set: XLA accepts the flags
  jzero derives from them and the losses are those of the run without;
- ``wire_dtypes``: stage 3 with bf16 compute and ``communication_data_type: bf16`` on all
  devices: the collectives' dtypes in the compiled HLO, unwidened on GPU (needs >= 2 devices);
- ``offload``: ZeRO-Offload + parameter offload (stage 3) against the same run on the device, one
  GPU, a 350M GPT: with the device memory capped (``XLA_PYTHON_CLIENT_MEM_FRACTION``) below what
  the device run needs, the device run fails and the offloaded one trains; uncapped, both runs'
  ``memory_stats()`` peaks and the step-time ratio;
- ``attention``: `jzero.attention` cudnn vs blockwise vs naive, causal, bf16, 16 heads of 128,
  T = 4096 and 16384: forward + backward time, compiled temporaries, and cuDNN's output against
  blockwise (each implementation apart: one that fails or does not fit is recorded as such);
- ``inference``: the KV-cached engine on a 350M GPT, bf16, one device: decode ms per step and
  tokens/s at 1, 8 and 32 slots with the weights on the device, in host memory (ZeRO-Inference)
  and in int8;
- ``tensor_parallel``: the collectives over the tensor and sequence groups of a Megatron-SP
  (tp 2) and a Ulysses (sp 2) step as XLA:GPU compiles them (needs >= 2 devices).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def platform_row(smoke: bool) -> dict:
    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return {"platform": device.platform, "device_kind": device.device_kind, "devices": jax.device_count(),
            "memory_gib": stats.get("bytes_limit", 0) / 2**30, "jax": jax.__version__}


def fused_adamw_row(smoke: bool, out: Path) -> dict:
    import jax

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fused_adamw

    sizes = fused_adamw.CPU_SIZES if smoke or jax.default_backend() == "cpu" else fused_adamw.ACCELERATOR_SIZES
    if smoke:
        sizes = {"1M": 1 << 20}

    def save(report: dict) -> None:
        (out / "fused_adamw.json").write_text(json.dumps(report, indent=2))
        (out / "fused_adamw.md").write_text(fused_adamw.markdown(report))

    report = fused_adamw.run(sizes, save)
    save(report)
    return {"backend": report["backend"], "checks": report["checks"],
            "rows": [{k: row[k] for k in row if k in ("case", "copy_gbs", "optax", "pallas", "pallas_vs_optax")}
                     for row in report["rows"]]}


def _train(out: Path, steps: int, smoke: bool, *overrides: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`jzero train` of the small GPT on one device in a subprocess; (process, metrics rows)."""
    args = [sys.executable, "-m", "jzero.cli", "train", str(ROOT / "configs" / "gpt_small_zero2.json"),
            "--out", str(out), "--steps", str(steps), "--devices", "1", "--no-resume",
            "--set", f"jzero.train.eval_interval={steps}", "--set", "jzero.checkpoint.interval=null", *overrides]
    if smoke:
        args += ["--set", "jzero.model.size=tiny", "--set", "jzero.data.max_bytes=200000"]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = list(csv.DictReader(open(out / "metrics.csv"))) if (out / "metrics.csv").exists() else []
    return proc, rows


def train_row(smoke: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc, rows = _train(Path(tmp), 20 if smoke else 300, smoke)
    summary = [line.strip() for line in proc.stdout.splitlines() if "│" in line]
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
    return {"first_loss": float(rows[0]["loss"]), "last_loss": float(rows[-1]["loss"]),
            "loss_falls": float(rows[-1]["loss"]) < float(rows[0]["loss"]), "summary": summary}


def xla_flags_row(smoke: bool) -> dict:
    steps = 10 if smoke else 50
    with tempfile.TemporaryDirectory() as tmp:
        _, plain = _train(Path(tmp) / "plain", steps, smoke)
        proc, flagged = _train(Path(tmp) / "flags", steps, smoke, "--set", "zero_optimization.overlap_comm=true",
                               "--set", "zero_optimization.reduce_bucket_size=200000000",
                               "--set", "zero_optimization.allgather_bucket_size=200000000")
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
    header = [line for line in proc.stdout.splitlines() if "communication flags" in line]
    return {"header": header, "same_losses": [r["loss"] for r in plain] == [r["loss"] for r in flagged]}


def wire_dtypes_row(smoke: bool) -> dict:
    import jax

    if jax.device_count() < 2:
        return {"skipped": f"needs >= 2 devices for collectives, this machine has {jax.device_count()}"}
    import jzero
    from jzero import models
    from jzero.analysis import profile

    cfg = jzero.load_config({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                             "communication_data_type": "bf16",
                             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                             "jzero": {"model": {"size": "tiny" if smoke else "small"}}})
    model = models.build(cfg)
    state = jzero.abstract_init(model.init_fn, cfg, loss_fn=model.loss_fn)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=state.plan.batch)
             for k, v in model.batch_spec(state.config.train_batch_size).items()}
    report = profile.comm(jzero.train_step.lower(state, batch).compile())
    by = report.by_kind_dtype()
    widened = sorted({c.widened_to for c in report.collectives if c.widened_to})
    return {"elements_by_kind_dtype": {f"{k} {d}": v for (k, d), v in by.items()}, "widened_to": widened}


def tensor_parallel_row(smoke: bool) -> dict:
    """The tensor and sequence groups' collectives as the GPU compiler writes them: Megatron-SP's
    reductions to token shards (an all-reduce and a slice on XLA:CPU; a reduce-scatter expected
    here) and Ulysses' all-to-alls, by kind and mesh axes, per step."""
    import jax

    if jax.device_count() < 2:
        return {"skipped": f"needs >= 2 devices for a tensor group, this machine has {jax.device_count()}"}
    import jzero
    from jzero.analysis import estimate, profile

    out = {}
    for name, split in (("megatron_sp_tp2", {"tensor_parallel": {"autotp_size": 2},
                                             "jzero": {"mesh": {"megatron_sequence_parallel": True}}}),
                        ("ulysses_sp2", {"sequence_parallel_size": 2})):
        jz = split.pop("jzero", {})
        cfg = jzero.load_config({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                 "zero_optimization": {"stage": 3}, **split,
                                 "jzero": {**jz, "model": {"size": "tiny" if smoke else "small"}}})
        step = estimate.compile_step(cfg)
        traffic = profile.by_axes(profile.comm(step.compiled), step.state.plan.mesh)
        out[name] = {f"{kind} over {'+'.join(axes)}": t.count for (kind, axes), t in sorted(traffic.items())}
    return out


OFFLOAD_CAP_GIB = 4.0  # the 350M GPT needs ~6 GiB on the device without offload, ~2.5 with


def offload_probe(offload: bool, smoke: bool) -> dict:
    """One process: a few steps of the 350M GPT (tiny with smoke) at stage 3 on one device, with or
    without offload; its step time and the device's peak bytes in use."""
    import jax

    import jzero
    from jzero import models

    cpu = {"device": "cpu", "pin_memory": True}
    zero = {"stage": 3, **({"offload_optimizer": cpu, "offload_param": cpu} if offload else {})}
    size = {"size": "tiny", "seq_len": 64} if smoke else {"size": "350m", "seq_len": 512}
    cfg = jzero.load_config({"train_micro_batch_size_per_gpu": 2 if smoke else 4, "bf16": {"enabled": True},
                             "zero_optimization": zero, "jzero": {"mesh": {"devices": 1}, "model": size}})
    model = models.build(cfg)
    state = jzero.init(model.init_fn, cfg, loss_fn=model.loss_fn, rng=0)
    batch = model.example_batch(state.config.train_batch_size)
    state, metrics = jzero.train_step(state, batch)
    float(metrics["loss"])
    t0 = time.perf_counter()
    steps = 3 if smoke else 10
    for _ in range(steps):
        state, metrics = jzero.train_step(state, batch)
    loss = float(metrics["loss"])
    stats = jax.devices()[0].memory_stats() or {}
    return {"step_s": (time.perf_counter() - t0) / steps, "loss": loss,
            "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
            "params": sum(x.size for x in jax.tree.leaves(state.params))}


def _probe(offload: bool, smoke: bool, cap_gib: float | None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if cap_gib is not None:
        import jax

        total = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0)
        if not total:
            return {"skipped": "the device reports no memory limit"}
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{cap_gib * 2**30 / total:.4f}"
    args = [sys.executable, str(Path(__file__).resolve()), "--offload-probe", str(int(offload))]
    proc = subprocess.run(args + (["--smoke"] if smoke else []), capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=env)
    if proc.returncode != 0:
        return {"ok": False, "error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]}
    return {"ok": True, **json.loads(proc.stdout.strip().splitlines()[-1])}


def offload_row(smoke: bool) -> dict:
    row = {"uncapped": {name: _probe(off, smoke, None) for name, off in (("device", False), ("offload", True))}}
    device, offload = row["uncapped"]["device"], row["uncapped"]["offload"]
    if device.get("ok") and offload.get("ok"):
        row["step_time_offload_vs_device"] = offload["step_s"] / device["step_s"]
        row["peak_offload_vs_device"] = offload["peak_gib"] / device["peak_gib"] if device["peak_gib"] else None
    if not smoke:
        row[f"capped_{OFFLOAD_CAP_GIB:g}_gib"] = {name: _probe(off, smoke, OFFLOAD_CAP_GIB)
                                                 for name, off in (("device", False), ("offload", True))}
    return row


def attention_row(smoke: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from jzero.analysis import profile
    from jzero.models.attention import attention

    heads, dim = (2, 16) if smoke else (16, 128)
    row = {}
    for t in ((256,) if smoke else (4096, 16384)):
        keys = jax.random.split(jax.random.key(t), 3)
        q, k, v = (jax.random.normal(key, (1, t, heads, dim), jnp.bfloat16) for key in keys)
        outs, cell = {}, {}
        for impl in ("cudnn", "blockwise", "naive"):
            try:
                def loss(q, k, v, impl=impl):
                    return jnp.sum(attention(q, k, v, causal=True, implementation=impl).astype(jnp.float32))

                step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
                jax.block_until_ready(step(q, k, v))
                times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    jax.block_until_ready(step(q, k, v))
                    times.append(time.perf_counter() - t0)
                outs[impl] = attention(q, k, v, causal=True, implementation=impl)
                cell[impl] = {"ms": 1e3 * sorted(times)[2], "temp_gib": profile.memory(step).temp / 2**30}
            except Exception as e:  # one implementation failing (or not fitting) is its result
                cell[impl] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        if "cudnn" in outs and "blockwise" in outs:
            diff = jnp.abs(outs["cudnn"].astype(jnp.float32) - outs["blockwise"].astype(jnp.float32))
            cell["cudnn_vs_blockwise_max_abs"] = float(jnp.max(diff))
        row[f"T={t}"] = cell
    return row


def inference_row(smoke: bool) -> dict:
    """The KV-cached engine on a 350M GPT in bf16 (random weights): ms per decode step and
    tokens/s at 1, 8 and 32 slots, weights on the device and in host memory (ZeRO-Inference),
    and int8 weights on the device; the compiled decode step's argument (device and host) and
    temporary bytes of each."""
    import jax
    import jax.numpy as jnp

    from jzero.inference import engine, sampling
    from jzero.models import gpt

    cfg = gpt.GPTConfig(seq_len=256, d_model=64, n_layers=2, n_heads=4, d_ff=256) if smoke else gpt.SIZES["350m"]
    params = jax.jit(gpt.make(cfg)[0])(jax.random.key(0))
    greedy, row = sampling.SamplingParams(temperature=0.0), {}
    for label, settings in (("device", {}), ("host", {"weights": "host"}), ("int8", {"int8_block": 64})):
        for slots in (1, 8, 32):
            try:
                eng = engine.Engine(gpt.decoder(cfg), params, slots=slots, chunk=128, dtype=jnp.bfloat16, **settings)
                state = eng.empty_state()
                prefix = eng.prefill_all(eng.start(greedy, 0), list(range(128)))
                for slot in range(slots):
                    state = eng.insert(prefix, state, slot)
                    prefix = eng.prefill_all(eng.start(greedy, 0), list(range(128)))
                times = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    state, step = eng.generate(state)
                    step.tokens.block_until_ready()
                    times.append(time.perf_counter() - t0)
                ms = 1e3 * sorted(times[2:])[len(times[2:]) // 2]
                mem = eng.executable("generate").memory_analysis()
                row[f"{label}/{slots}"] = {"ms_per_step": ms, "tokens_per_s": slots / ms * 1e3,
                                           "arguments_gib": mem.argument_size_in_bytes / 2**30,
                                           "host_arguments_gib": mem.host_argument_size_in_bytes / 2**30,
                                           "temp_gib": mem.temp_size_in_bytes / 2**30}
                del eng, state, prefix
            except Exception as e:  # one variant failing is its result
                row[f"{label}/{slots}"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return row


def markdown(report: dict) -> str:
    lines = [f"jzero GPU check, {report['started']}", "", "| row | status | seconds | result |", "|---|---|---|---|"]
    for row in report["rows"]:
        result = row.get("error") or json.dumps(row.get("result"))[:400]
        lines.append(f"| {row['name']} | {row['status']} | {row['seconds']:.1f} | {result} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "benchmarks" / "results")),
                        help="folder for gpu_check.{json,md} (default: $OUT, else benchmarks/results)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a dry run of every row (CPU)")
    parser.add_argument("--only", action="append", help="run only these rows (repeatable)")
    parser.add_argument("--offload-probe", type=int, choices=[0, 1], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.offload_probe is not None:  # the offload row's subprocess: one JSON line
        print(json.dumps(offload_probe(bool(args.offload_probe), args.smoke)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, Callable[[], dict]] = {
        "platform": lambda: platform_row(args.smoke),
        "fused_adamw": lambda: fused_adamw_row(args.smoke, args.out),
        "train": lambda: train_row(args.smoke),
        "xla_flags": lambda: xla_flags_row(args.smoke),
        "wire_dtypes": lambda: wire_dtypes_row(args.smoke),
        "offload": lambda: offload_row(args.smoke),
        "attention": lambda: attention_row(args.smoke),
        "inference": lambda: inference_row(args.smoke),
        "tensor_parallel": lambda: tensor_parallel_row(args.smoke),
    }
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "smoke": args.smoke, "rows": []}
    for name, fn in rows.items():
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        try:
            row = {"name": name, "status": "ok", "result": fn()}
            if "skipped" in row["result"]:
                row["status"] = "skipped"
        except Exception as e:  # one failing claim must not lose the others
            row = {"name": name, "status": "failed", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                   "traceback": traceback.format_exc()[-2000:]}
        row["seconds"] = time.perf_counter() - t0
        report["rows"].append(row)
        print(f"[gpu_check] {name}: {row['status']} ({row['seconds']:.1f} s)", flush=True)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        (args.out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
