"""Continuous vs static batching on a seeded Poisson request trace, and the decode step alone.

    python benchmarks/inference.py            # 200 requests x 3 rates; CPU figures
    python benchmarks/inference.py --fast     # 60 requests: a dry run

Two traces of ``--requests`` requests, each a random 128-token prompt (greedy, no stop token, so
both policies do the same work), arriving as a Poisson process at three rates: 0.5x, 1x and 2x
the rate static batching sustains on that trace on this machine (measured first, so the rates
mean the same load on any machine). ``fixed``: 32 new tokens each, static batching's best case
(every request of a batch ends on the same step); ``varied``: 8 to 56 new tokens (uniform, mean
32), as real requests vary, where a static batch holds its slots until its longest request ends.
Both policies run the same engine (8 slots, chunk 128) and the same compiled programs,
compiled before the clock starts (compile time is reported apart). Per run: output tokens/s and
requests/s (over the first arrival to the last finish), time to first token and time per output
token, p50 / p90 / p99. The decode microbenchmark: ms per `generate` step at 1, 8 and 32 slots,
and the bytes it must read (weights + the whole cache) over that time. Prints a table; writes
``benchmarks/results/inference.{json,md,png}``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jzero.inference import engine, sampling
from jzero.inference.scheduler import Request, Scheduler
from jzero.models import gpt

RESULTS = Path(__file__).resolve().parent / "results"
CFG = gpt.GPTConfig(seq_len=256, d_model=256, n_layers=4, n_heads=4, d_ff=1024)
PROMPT, OUTPUT, SLOTS, CHUNK = 128, 32, 8, 128
GREEDY = sampling.SamplingParams(temperature=0.0)


def trace(n: int, rate: float, seed: int = 0, varied: bool = False) -> list[Request]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    outputs = rng.integers(OUTPUT // 4, OUTPUT * 7 // 4 + 1, n) if varied else np.full(n, OUTPUT)
    return [Request(rng.integers(0, CFG.vocab_size, PROMPT), int(out), GREEDY, id=i, arrival=float(a))
            for i, (a, out) in enumerate(zip(arrivals, outputs, strict=True))]


def serve(eng: engine.Engine, requests: list[Request], static: bool) -> dict:
    began = time.perf_counter()
    done = Scheduler(eng, static=static, clock=lambda: time.perf_counter() - began).run(requests)
    ttft = [p.first_token - p.request.arrival for p in done]
    tpot = [(p.finished - p.first_token) / (len(p.tokens) - 1) for p in done]
    span = max(p.finished for p in done) - min(p.request.arrival for p in done)
    pct = {f"{name}_p{q}_ms": 1e3 * float(np.percentile(xs, q)) for name, xs in (("ttft", ttft), ("tpot", tpot))
           for q in (50, 90, 99)}
    return {"tokens_per_s": sum(len(p.tokens) for p in done) / span, "requests_per_s": len(done) / span, **pct}


def warmed(eng: engine.Engine) -> float:
    """Compile every program the trace uses; their seconds."""
    Scheduler(eng).run(trace(SLOTS + 1, 1e6, seed=99))
    Scheduler(eng, static=True).run(trace(SLOTS + 1, 1e6, seed=98))
    return sum(c.seconds for c in eng.compiles)


def decode_step(params, slots: int, reps: int) -> dict:
    """ms per generate step with every slot active, and weights + cache bytes over it."""
    eng = engine.Engine(gpt.decoder(CFG), params, slots=slots, chunk=CHUNK)
    state = eng.empty_state()
    prefix = eng.prefill_all(eng.start(GREEDY, 0), np.arange(PROMPT) % CFG.vocab_size)
    for slot in range(slots):
        state = eng.insert(jax.tree.map(jnp.copy, prefix), state, slot)
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        state, step = eng.generate(state)
        step.tokens.block_until_ready()
        times.append(time.perf_counter() - began)
    ms = 1e3 * statistics.median(times[1:])
    weights = sum(x.nbytes for x in jax.tree.leaves(eng.params))
    cache = sum(x.nbytes for x in state.cache)
    return {"slots": slots, "ms": ms, "weights_mib": weights / 2**20, "cache_mib": cache / 2**20,
            "gb_per_s": (weights + cache) / (ms / 1e3) / 1e9, "tokens_per_s": slots / (ms / 1e3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--fast", action="store_true", help="60 requests, fewer decode reps")
    args = parser.parse_args()
    n = 60 if args.fast else args.requests
    params = jax.jit(gpt.make(CFG)[0])(jax.random.key(0))
    eng = engine.Engine(gpt.decoder(CFG), params, slots=SLOTS, chunk=CHUNK)
    compile_s = warmed(eng)
    runs, capacity = [], {}
    for lengths in ("fixed", "varied"):
        varied = lengths == "varied"
        capacity[lengths] = serve(eng, trace(4 * SLOTS, 1e6, seed=7, varied=varied), static=True)["requests_per_s"]
        for factor in (0.5, 1.0, 2.0):
            for policy in ("continuous", "static"):
                requests = trace(n, factor * capacity[lengths], seed=int(factor * 10), varied=varied)
                row = serve(eng, requests, static=policy == "static")
                runs.append({"lengths": lengths, "rate_factor": factor, "rate": factor * capacity[lengths],
                             "policy": policy, **row})
                print(runs[-1], flush=True)
    decode = [decode_step(params, slots, 10 if args.fast else 30) for slots in (1, 8, 32)]
    write({"model": vars(CFG) | {"attention": None, "moe": None, "sparse_attention": None},
           "requests": n, "prompt": PROMPT, "output": OUTPUT, "slots": SLOTS, "chunk": CHUNK,
           "compile_s": compile_s, "static_capacity_rps": capacity, "runs": runs, "decode": decode,
           "backend": jax.default_backend()}, "_fast" if args.fast else "")


def write(result: dict, suffix: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"inference{suffix}.json").write_text(json.dumps(result, indent=1, default=str))
    capacity = ", ".join(f"{k} {v:.2f}" for k, v in result["static_capacity_rps"].items())
    lines = [f"CPU figures ({result['backend']}, 2 cores): GPT {CFG.n_layers} layers x {CFG.d_model}, "
             f"{result['requests']} requests of {PROMPT} prompt tokens + {OUTPUT} new (fixed) or "
             f"{OUTPUT // 4}-{OUTPUT * 7 // 4} (varied), {SLOTS} slots; static batching sustains (req/s) "
             f"{capacity}; compile {result['compile_s']:.1f} s (apart)", "",
             "| lengths | rate (x static) | policy | out tok/s | req/s | TTFT p50 / p90 / p99 (ms) | "
             "TPOT p50 / p90 / p99 (ms) |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['lengths']} | {r['rate_factor']} ({r['rate']:.2f}/s) | {r['policy']} | {r['tokens_per_s']:.0f} | "
              f"{r['requests_per_s']:.2f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
              f"{r['tpot_p50_ms']:.1f} / {r['tpot_p90_ms']:.1f} / {r['tpot_p99_ms']:.1f} |" for r in result["runs"]]
    lines += ["", "| decode slots | ms / step | tokens/s | weights + cache (MiB) | GB/s read |",
              "|---|---|---|---|---|"]
    lines += [f"| {d['slots']} | {d['ms']:.2f} | {d['tokens_per_s']:.0f} | {d['weights_mib']:.1f} + "
              f"{d['cache_mib']:.1f} | {d['gb_per_s']:.2f} |" for d in result["decode"]]
    (RESULTS / f"inference{suffix}.md").write_text("\n".join(lines) + "\n")
    _plot(result, RESULTS / f"inference{suffix}.png")
    print("\n".join(lines))


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for lengths, style in (("fixed", "--"), ("varied", "-")):
        for policy in ("continuous", "static"):
            mine = [r for r in result["runs"] if r["policy"] == policy and r["lengths"] == lengths]
            for ax, key in zip(axes, ("tokens_per_s", "ttft_p90_ms"), strict=True):
                ax.plot([r["rate_factor"] for r in mine], [r[key] for r in mine], style, marker="o",
                        label=f"{policy}, {lengths} lengths")
    for ax, label in zip(axes, ("output tokens/s", "time to first token, p90 (ms)"), strict=True):
        ax.set(xlabel="arrival rate (x what static batching sustains)", ylabel=label)
        ax.legend(fontsize=8)
    fig.suptitle("continuous vs static batching, Poisson trace (CPU figures)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
