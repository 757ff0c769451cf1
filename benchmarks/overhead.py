"""Engine overhead: jzero's step at ZeRO stages 0-3 against a hand-written ``jit`` + optax step.

The promise is ZeRO at no cost over the step a JAX user writes by hand, so this measures exactly
that, on the same model (the reference GPT), data, dtype and devices: the hand-written step is
replicated params, a batch sharded over the devices, ``jax.value_and_grad`` of the same loss and
``optax.adamw`` (bf16: the params cast to bf16 inside the loss, fp32 master, as one writes it).
Variants run interleaved, repetition after repetition, each timed as the median of its steps,
and a row reports the median of the repetitions and their spread, as tokens/s and as a ratio to
the hand-written step of the same repetition.

    python benchmarks/overhead.py                  # the full table (2 sizes x fp32/bf16 at 2 devices, 25M at 8)
    python benchmarks/overhead.py --fast           # before merging a change to the step, hooks or layers
    python benchmarks/overhead.py --baseline-rev HEAD~1   # also jzero at REV, from a temporary worktree
    python benchmarks/overhead.py --profile --groups 25M/fp32/2 --stages 1   # where the time goes
    python benchmarks/overhead.py --groups 25M/fp32/2/plain 25M/fp32/2/linen  # a user's models (user_models.py)
    python benchmarks/overhead.py --target tpu:v5e:2x2   # TPU-compiled: FLOPs, bytes, memory, comm

Each checkout runs in its own worker process (the current one also runs the hand-written step), fed
one variant at a time, so repetitions interleave across checkouts too. Writes
``benchmarks/results/overhead{,_fast}.{json,md,png}``. On CPU the devices are simulated and share
the host's cores: the ratios are the result, not the absolute times.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__" and {"--serve", "--profile"} & set(sys.argv):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
if __name__ == "__main__":  # simulated CPU devices; --target compiles for abstract TPU ones: no TPU probe
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# The reference GPT at two sizes (vocab 256, 128 tokens): ~3.3M and ~25.5M params.
SIZES = {"3M": dict(d_model=256, n_layers=4, n_heads=4, d_ff=1024),
         "25M": dict(d_model=512, n_layers=8, n_heads=8, d_ff=2048)}
BATCH, SEQ, LR, WEIGHT_DECAY = 16, 128, 1e-3, 0.01
HAND = "hand-written"
HAND_NORM = "hand-written + grad norm"  # a control: the same step also returning optax.tree.norm(grads)
STAGES = [f"stage {s}" for s in range(4)]
FULL = [("3M", "fp32", 2), ("3M", "bf16", 2), ("25M", "fp32", 2), ("25M", "bf16", 2), ("25M", "fp32", 8)]
FAST = [("25M", "fp32", 2)]


# ---- worker: builds and times one variant at a time (imports JAX and the checkout's jzero) ----

def _gpt_module():
    try:
        from jzero.models import gpt
    except ImportError:  # checkouts before the layer folders (issue 29)
        from jzero import gpt
    return gpt


def _batch(sharding) -> dict:
    """The same random tokens (vocab 256) for every variant, laid out as ``sharding``."""
    import jax
    import numpy as np

    tok = np.random.default_rng(0).integers(0, 256, (BATCH, SEQ + 1)).astype(np.int32)
    return {"inputs": jax.device_put(tok[:, :-1], sharding), "targets": jax.device_put(tok[:, 1:], sharding)}


def hand_step(loss_fn, tx, dtype: str, norm: bool, clip: float = 0.0):
    """The step a JAX user writes: value_and_grad of the loss on params cast to the compute dtype
    (fp32 master), optax's update; with ``norm`` it also returns the gradients' global norm, as
    jzero's step does, and with ``clip`` > 0 scales them to at most that norm, as jzero's
    ``gradient_clipping`` does (the same math, so the comparison is honest)."""
    import jax
    import jax.numpy as jnp
    import optax

    low = jnp.bfloat16 if dtype == "bf16" else jnp.float32

    def step(state, batch):
        params, opt_state = state
        cast = jax.tree.map(lambda p: p.astype(low), params)
        loss, grads = jax.value_and_grad(lambda p: loss_fn(p, batch, jax.random.key(0)))(cast)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        gnorm = optax.tree.norm(grads) if norm or clip else None
        if clip:
            grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, clip / (gnorm + 1e-6)), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), (loss, gnorm if norm else None)

    return step


def _hand_written(init_fn, loss_fn, dtype: str, devices, norm: bool):
    """`hand_step` on replicated params and a batch sharded over ``devices`` (GSPMD's data parallelism)."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    params = jax.device_put(jax.jit(init_fn)(jax.random.key(0)), NamedSharding(mesh, P()))
    tx = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
    step = hand_step(loss_fn, tx, dtype, norm)
    return jax.jit(step, donate_argnums=(0,)), (params, tx.init(params)), _batch(NamedSharding(mesh, P("data")))


def _jzero(init_fn, loss_fn, dtype: str, devices, stage: int):
    import jzero

    cfg = jzero.load_config({
        "train_batch_size": BATCH, "gradient_clipping": 0.0, "bf16": {"enabled": dtype == "bf16"},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}}}, dp_size=len(devices))
    mesh = jzero.make_mesh(cfg, devices=devices)
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=0, mesh=mesh)
    return jzero.train_step, state, _batch(state.plan.batch)


def _build(group: tuple, variant: str):
    """(step, state, batch) of ``variant`` for the group (size, dtype, devices[, model]), compiled
    and warmed up by two steps (the hand-written step compiles again on its second call: its
    output's layout is not its input's)."""
    import jax

    size, dtype, n, model = (*group, "gpt")[:4]
    if model == "gpt":  # through _gpt_module: a baseline checkout may predate the models folder
        gpt = _gpt_module()
        init_fn, loss_fn = gpt.make(gpt.GPTConfig(vocab_size=256, seq_len=SEQ, **SIZES[size]))
    else:
        import user_models

        init_fn, loss_fn = user_models.make(model, vocab_size=256, seq_len=SEQ, **SIZES[size])
    devices = jax.devices()[:n]
    if variant in (HAND, HAND_NORM):
        step, state, batch = _hand_written(init_fn, loss_fn, dtype, devices, norm=variant == HAND_NORM)
    else:
        step, state, batch = _jzero(init_fn, loss_fn, dtype, devices, int(variant.split()[-1]))
    for _ in range(2):
        state, out = step(state, batch)
    jax.block_until_ready(out)
    return step, state, batch


def serve() -> None:
    """Answer one JSON request per stdin line, ``{"group": [size, dtype, n], "variant": v,
    "steps": k}``, with ``{"seconds": [per-step seconds]}`` (or ``{"error": ...}``)."""
    import jax

    built: dict[str, list] = {}
    group = None
    for line in sys.stdin:
        req = json.loads(line)
        if req["group"] != group:
            group, built = req["group"], {}
            jax.clear_caches()
        try:
            if req["variant"] not in built:
                built[req["variant"]] = list(_build(group, req["variant"]))
            entry = built[req["variant"]]
            times = []
            for _ in range(req["steps"]):
                t = time.perf_counter()
                entry[1], out = entry[0](entry[1], entry[2])
                jax.block_until_ready(out)
                times.append(time.perf_counter() - t)
            reply = {"seconds": times}
        except Exception as e:  # one failing variant must not end the run
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)


def profile(group: tuple, variants: list[str], steps: int) -> None:
    """Where a variant's step goes, beside the hand-written one's: the compiled program's
    instructions by opcode, its bytes accessed (XLA's cost analysis), and the time per op
    category summed over XLA:CPU's threads, from a profiler trace of ``steps`` steps."""
    import collections
    import re

    import jax

    for variant in [HAND, HAND_NORM, *variants]:
        step, state, batch = _build(group, variant)
        compiled = step.lower(state, batch).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        ops = collections.Counter(re.findall(r"^\s*(?:ROOT )?%\S+ = .*? ([a-z][\w\-]*)\(", compiled.as_text(), re.M))
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                for _ in range(steps):
                    state, out = step(state, batch)
                    jax.block_until_ready(out)
            trace = jax.profiler.ProfileData.from_file(str(next(Path(d).rglob("*.xplane.pb"))))
        spent: collections.Counter = collections.Counter()
        for plane in trace.planes:
            for line in plane.lines:
                if line.name.startswith("tf_XLAEigen"):
                    for event in line.events:
                        if not event.name.startswith(("ThunkExecutor", "SlinkyThreadPool", "end: ")):
                            spent[re.sub(r"\.\d+$", "", event.name)] += event.duration_ns / steps / 1e6
        print(f"== {variant}: {sum(ops.values())} instructions, {cost.get('bytes accessed', 0) / 1e9:.3f} GB accessed")
        print("   opcodes: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))
        print("   ms per step (thread time): " + ", ".join(f"{k} {v:.0f}" for k, v in spent.most_common(14)))


# ---- driver: no JAX here; interleaves the workers' variants and writes the results ----

class Worker:
    """One checkout's worker process (``python overhead.py --serve`` on its jzero)."""

    def __init__(self, label: str, root: Path):
        env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.label = label
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def time(self, group: tuple, variant: str, steps: int) -> dict:
        self.proc.stdin.write(json.dumps({"group": group, "variant": variant, "steps": steps}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        return json.loads(line) if line else {"error": f"worker {self.label} exited ({self.proc.wait()})"}

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


@contextlib.contextmanager
def worktree(rev: str):
    """A temporary detached worktree of ``rev``, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="jzero-baseline-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)


def measure(workers: list[Worker], groups: list[tuple], reps: int, steps: int, stages: list[str],
            on_row) -> list[dict]:
    """Interleave every (worker, variant) of each group ``reps`` times; a row per variant."""
    rows = []
    for group in groups:
        variants = [(workers[0], HAND), (workers[0], HAND_NORM)] + [(w, v) for w in workers for v in stages]
        samples: dict[tuple, list] = {(w.label, v): [] for w, v in variants}
        for rep in range(reps):
            order = variants if rep % 2 == 0 else variants[::-1]  # no variant always runs first
            for w, v in order:
                reply = w.time(group, v, steps)
                samples[(w.label, v)].append(statistics.median(reply["seconds"]) if "seconds" in reply
                                             else reply["error"])
                print(f"  {'/'.join(map(str, group))} rep {rep + 1} {w.label} {v}: {samples[(w.label, v)][-1]}",
                      flush=True)
        rows += summarize(group, samples)
        on_row(rows)
    return rows


def summarize(group: tuple, samples: dict) -> list[dict]:
    """Rows of one group: median step, tokens/s per repetition, median ratio to hand-written."""
    size, dtype, n, model = (*group, "gpt")[:4]
    base = samples[(next(iter(samples))[0], HAND)]
    rows = []
    for (label, variant), secs in samples.items():
        row = {"model": size if model == "gpt" else f"{model} {size}", "dtype": dtype, "devices": n,
               "checkout": label, "variant": variant}
        errors = [s for s in secs if isinstance(s, str)]
        if errors or any(isinstance(b, str) for b in base):
            rows.append({**row, "error": (errors or ["hand-written step failed"])[0]})
            continue
        ratios = [b / s for b, s in zip(base, secs, strict=True)]  # > 1: faster than hand-written
        rows.append({**row, "step_s": secs, "tokens_per_s": [BATCH * SEQ / s for s in secs],
                     "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)})
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| model | dtype | devices | checkout | variant | tokens/s, reps | median vs hand-written (min-max) |\n"
            "|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        where = f"| {r['model']} | {r['dtype']} | {r['devices']} | {r['checkout']} | {r['variant']} |"
        if "error" in r:
            lines.append(f"{where} failed: {r['error'][:80]} | |")
            continue
        toks = ", ".join(f"{t:.0f}" for t in r["tokens_per_s"])
        lines.append(f"{where} {toks} | {r['ratio']:.3f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |")
    return head + "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r and r["variant"] in STAGES]
    series = sorted({(r["model"], r["dtype"], r["devices"], r["checkout"]) for r in ok})
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(len(series), 1)
    for i, key in enumerate(series):
        sel = [r for r in ok if (r["model"], r["dtype"], r["devices"], r["checkout"]) == key]
        x = [STAGES.index(r["variant"]) + i * width for r in sel]
        y = [r["ratio"] for r in sel]
        err = [[r["ratio"] - r["ratio_min"] for r in sel], [r["ratio_max"] - r["ratio"] for r in sel]]
        ax.bar(x, y, width, yerr=err, capsize=2, label=" ".join(f"{k}" for k in key[:2]) + f" {key[2]} dev {key[3]}")
    ax.axhline(1.0, color="black", lw=1)
    ax.set_xticks([s + 0.4 - width / 2 for s in range(4)], [f"ZeRO-{s}" for s in range(4)])
    ax.set_ylim(0.6, 1.25)
    ax.set_ylabel("step speed / hand-written jit+optax")
    ax.set_title("jzero step vs hand-written (median of interleaved reps, bars: min-max)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write(rows: list[dict], out: Path, name: str, meta: dict, table=None, figure=None) -> None:
    """NAME.json, NAME.md and NAME.png under ``out``: this table and figure, or the given ones
    (the cost mode's, `overhead_cost`)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    (out / f"{name}.md").write_text((table or markdown)(rows))
    (figure or plot)(rows, out / f"{name}.png")


def cost_mode(args: argparse.Namespace) -> None:
    """``--target``: the compiled-cost table (`overhead_cost`), written as overhead_TARGET_SIZE.{json,md,png}."""
    import overhead_cost

    name = f"overhead_{args.target.replace(':', '_')}_{args.size}"
    meta = {"target": args.target, "batch": BATCH, "seq": SEQ, "size": args.size}
    rows = overhead_cost.measure(args.target, args.models, SIZES, args.size, args.dtypes, args.clip, args.stages,
                                 BATCH, SEQ, LR, WEIGHT_DECAY,
                                 lambda rows: write(rows, args.out, name, meta, overhead_cost.markdown,
                                                    overhead_cost.plot))
    print(overhead_cost.markdown(rows))
    print(f"wrote {args.out / name}.json, .md, .png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="25M fp32 at 2 devices, 2 reps: the pre-merge check")
    parser.add_argument("--reps", type=int, help="interleaved repetitions (default 5; --fast: 2)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per repetition (median)")
    parser.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3], choices=range(4))
    parser.add_argument("--groups", nargs="+", help="size/dtype/devices, e.g. 25M/bf16/2 (default: the full table)")
    parser.add_argument("--baseline-rev", help="also time jzero at this git revision (a temporary worktree)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--profile", action="store_true",
                        help="instead of timing: opcodes, bytes and time per op of the first group's variants")
    parser.add_argument("--target", help="compiled-cost mode (overhead_cost.py): compile, never run, for this "
                        "target, e.g. tpu:v5e:2x2; FLOPs, bytes, peak memory and collective bytes vs hand-written")
    parser.add_argument("--models", nargs="+", default=["gpt", "plain", "linen"],
                        help="cost mode: models (user_models.py)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"], help="cost mode")
    parser.add_argument("--clip", nargs="+", type=float, default=[0.0, 1.0], help="cost mode: gradient_clipping values")
    parser.add_argument("--size", default="25M", choices=sorted(SIZES), help="cost mode: model size")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve()
    if args.target:
        return cost_mode(args)
    groups = ([tuple(int(p) if p.isdigit() else p for p in g.split("/")) for g in args.groups] if args.groups
              else FAST if args.fast else FULL)
    if args.profile:
        return profile(groups[0], [STAGES[s] for s in args.stages], steps=3)
    reps = args.reps or (2 if args.fast else 5)
    name = "overhead_fast" if args.fast else "overhead"
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    meta = {"head": head, "baseline_rev": args.baseline_rev, "reps": reps, "steps": args.steps,
            "batch": BATCH, "seq": SEQ, "cpu_count": os.cpu_count()}
    with contextlib.ExitStack() as stack:
        workers = [Worker("current", ROOT)]
        if args.baseline_rev:
            workers.append(Worker(args.baseline_rev, stack.enter_context(worktree(args.baseline_rev))))
        stages = [STAGES[s] for s in args.stages]
        try:
            rows = measure(workers, groups, reps, args.steps, stages,
                           lambda rows: write(rows, args.out, name, meta))
        finally:
            for w in workers:
                w.close()
    print(markdown(rows))
    print(f"wrote {args.out / name}.json, .md, .png")


if __name__ == "__main__":
    main()
