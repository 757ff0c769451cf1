"""The vision tasks (`jzero.tasks`): ViT, the plain MLP and CLIP equal a plain single-device jit + optax loop
at every stage (CLIP's contrastive loss over the gathered global batch included), their data's
bad input is one line naming the file or key, and `jzero train` / resume / export / autotune /
estimate run them."""
import functools
import json

import jax
import numpy as np
import pytest

import jzero
from jzero.config import ConfigError
from jzero.models import clip, mlp, vit
from jzero.train.step import eval_step

from helpers import init_on, jzero_cli, plain_loop, read_csv

STEPS, BATCH = 10, 32
SPECS = {"vit": vit.ViTConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64),
         "clip": clip.CLIPConfig(d_model=32, n_layers=2, text_layers=2, n_heads=2, d_ff=64, text_len=8,
                                 embed_dim=16),
         "mlp": mlp.MLPConfig(d_model=32, n_layers=2, d_ff=64)}
MAKE = {"vit": vit.make, "clip": clip.make, "mlp": mlp.make}


def batches(name):
    """STEPS batches; the classifiers' repeat one batch (the loss must fall within ten steps)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        images = rng.random((BATCH, 8, 8, 1), np.float32)
        if name != "clip":
            out.append(out[0] if out else {"images": images, "labels": np.arange(BATCH, dtype=np.int32) % 10})
        else:  # captions that depend on the image, so the pairs are learnable
            texts = np.clip((images.reshape(BATCH, -1)[:, :8] * 9).astype(np.int32) + 1, 1, 255)
            out.append({"images": images, "texts": texts})
    return out


def micro_batches(batch, ndev, accum):
    """The step's micro-batches as one device sees them all: micro-batch j takes the j-th chunk
    of every device's rows, in device order (the order `jzero.gather_rows` stacks them in)."""
    def split(x):
        return x.reshape(ndev, accum, -1, *x.shape[1:]).swapaxes(0, 1).reshape(accum, -1, *x.shape[1:])

    return jax.tree.map(split, batch)


@functools.cache
def reference(name, ndev, accum):
    """The plain loop: the loss averaged over the step's micro-batches."""
    return plain_loop(*MAKE[name](SPECS[name]), batches(name), lambda b: micro_batches(b, ndev, accum))[0]


# The default suite runs every stage once for the ViT, alternating 8 devices (accumulation 1)
# and 2 devices (4); CLIP (the same step code, a slower compile) at stages 1 and 3; the MLP at
# two stages. The slow suite adds the ViT's full matrix (stages 0-3 x 8 and 2 devices x
# accumulation 1 and 4) and CLIP's every stage at both default configurations (device count
# and accumulation are the step's business, which the ViT's matrix already proves).
CASES = ([("vit", 0, 8, 1), ("vit", 1, 2, 4), ("vit", 2, 8, 1), ("vit", 3, 2, 4)]
         + [("clip", 1, 8, 4), ("clip", 3, 2, 1)]
         + [("mlp", 1, 8, 4), ("mlp", 3, 2, 1)])
MATRIX = ([("vit", s, n, a) for s in (0, 1, 2, 3) for n in (8, 2) for a in (1, 4)]
          + [("clip", s, n, a) for s in (0, 1, 2, 3) for n, a in ((8, 4), (2, 1))]
          + [case for case in CASES if case[0] == "mlp"])
ALL = [pytest.param(*case, id="{}-zero{}-{}dev-accum{}".format(*case),
                    marks=() if case in CASES else pytest.mark.slow) for case in MATRIX]


@pytest.mark.parametrize("name,stage,ndev,accum", ALL)
def test_matches_plain_optax_loop(name, stage, ndev, accum):
    state = init_on(*MAKE[name](SPECS[name]), stage, ndev, accum, BATCH)
    losses = []
    for batch in batches(name):
        state, metrics = jzero.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, reference(name, ndev, accum), rtol=1e-5)
    assert losses[-1] < losses[0]


def test_clip_loss_over_gathered_rows_is_the_global_batch_loss():
    """One evaluation: 8 devices each holding 4 rows give the single-device loss of all 32; a
    loss over each device's rows alone (no gather) would differ (the test can fail)."""
    init_fn, loss_fn = clip.make(SPECS["clip"])
    batch = batches("clip")[0]
    cfg = jzero.load_config({"train_batch_size": BATCH, "zero_optimization": {"stage": 2}})
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=jax.random.key(0))
    loss_fn = jax.jit(loss_fn)
    whole = float(loss_fn(jax.device_get(state.params), batch, jax.random.key(0)))
    assert float(eval_step(state, batch)) == pytest.approx(whole, rel=1e-5)
    params = jax.device_get(state.params)
    per_device = np.mean([float(loss_fn(params, {k: v[4 * i:4 * i + 4] for k, v in batch.items()}, jax.random.key(0)))
                          for i in range(8)])
    assert abs(per_device - whole) > 1e-3


def write_folder(tmp_path, sizes):
    from PIL import Image

    for i, size in enumerate(sizes):
        folder = tmp_path / f"class{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.zeros(size, np.uint8)).save(folder / f"{i}.png")
    return tmp_path


def bad_vision_config(tmp_path, case):
    path, model = None, {"name": "vit", "size": "tiny"}
    if case == "mixed sizes":
        path = write_folder(tmp_path, [(8, 8), (8, 8), (9, 8)])
    elif case == "no labels":
        path = tmp_path / "x.npz"
        np.savez(path, images=np.zeros((4, 8, 8), np.uint8))
    elif case == "classes":
        model["num_classes"] = 5
    elif case == "image size":
        model["image_size"] = 16
    data = {"path": str(path)} if path else {}
    return jzero.load_config({"train_batch_size": 8, "jzero": {"model": model, "data": data}}, dp_size=8)


@pytest.mark.parametrize("case,message", [
    ("mixed sizes", r"2\.png is \(9, 8\), but .*0\.png is \(8, 8\): all images must have one size"),
    ("no labels", r"x\.npz has no 'labels' array"),
    ("classes", r"jzero\.model\.num_classes: 5, but digits .* has 10 classes"),
    ("image size", r"jzero\.model\.image_size / channels: the model takes 16x16x1 images"),
])
def test_bad_image_data_is_one_line_naming_file_or_key(tmp_path, case, message):
    from jzero import tasks

    with pytest.raises(ConfigError, match=message):
        tasks.build(bad_vision_config(tmp_path, case))


def test_user_npz_and_folder_train_the_classifier(tmp_path):
    from jzero import tasks
    from jzero.tasks import images

    np.savez(tmp_path / "d.npz", images=np.random.default_rng(0).integers(0, 255, (40, 8, 8), np.uint8),
             labels=np.arange(40) % 4, class_names=np.array(["a", "b", "c", "d"]))
    cfg = jzero.load_config({"train_batch_size": 8, "jzero": {"model": {"name": "vit", "num_classes": 4},
                                                              "data": {"path": str(tmp_path / "d.npz")}}}, dp_size=8)
    task = tasks.build(cfg)
    assert task.describe.startswith(str(tmp_path / "d.npz")) and "4 classes" in task.describe
    folder = images.load_images(jzero.load_config(
        {"train_batch_size": 8, "jzero": {"data": {"path": str(write_folder(tmp_path / "f", [(8, 8)] * 6)),
                                                   "heldout_fraction": 0.5}}}).jzero.data)
    assert folder.class_names == ("class0", "class1") and folder.train.shape == (3, 8, 8, 1)


VISION_FAST = ["--steps", "6", "--devices", "2", "--set", "jzero.train.eval_interval=3",
               "--set", "jzero.train.eval_batches=1", "--set", "steps_per_print=1",
               "--set", "scheduler.params.warmup_num_steps=1"]


@pytest.mark.slow  # three short runs and their resumes: about a minute on 2 cores
@pytest.mark.parametrize("config,columns", [("vit_digits", ["eval_accuracy"]), ("mlp_digits", ["eval_accuracy"]),
                                            ("clip_digits", ["zeroshot_accuracy", "i2t_recall1", "t2i_recall1"])])
def test_cli_trains_vision_configs_resumes_and_exports(tmp_path, config, columns):
    out = tmp_path / config
    proc = jzero_cli("train", f"configs/{config}.json", "--out", str(out), *VISION_FAST,
                     "--set", "jzero.checkpoint.interval=3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = read_csv(out / "metrics.csv")
    assert list(rows[0])[-len(columns):] == columns
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])
    assert all(0 <= float(rows[-1][c]) <= 1 for c in columns)
    again = jzero_cli("train", f"configs/{config}.json", "--out", str(out), *VISION_FAST, "--steps", "8",
                      "--set", "jzero.checkpoint.interval=3")
    assert again.returncode == 0 and "resuming from step 6" in again.stdout, again.stderr[-2000:]
    assert [int(r["step"]) for r in read_csv(out / "metrics.csv")][-2:] == [7, 8]
    exported = jzero_cli("export", str(out / "checkpoints"), str(tmp_path / "w.safetensors"))
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (tmp_path / "w.safetensors").stat().st_size > 0


@pytest.mark.slow  # two AOT compiles of B/16 models for 64 devices
@pytest.mark.parametrize("config,params", [("vit_b16", 86.4e6), ("clip_b16", 172e6)])
def test_estimate_b16_on_64_devices_matches_zero3_formula(config, params):
    proc = jzero_cli("estimate", f"configs/{config}.json", "--devices", "64", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(proc.stdout)["stages"]
    assert row["persistent_bytes_per_param"] == pytest.approx(12 / 64, rel=0.02)
    assert row["comm_elements_per_param"] == pytest.approx(3.0, rel=0.05)
    assert row["params_gib"] * 2**30 / 4 * 64 == pytest.approx(params, rel=0.1)


@pytest.mark.slow  # three AOT compiles and timed candidates: about 15 s on 2 cores
def test_autotune_ranks_a_vision_task():
    from jzero.analysis import autotune

    raw = {**json.load(open("configs/vit_digits.json")), "train_batch_size": 8}  # micro 1, 2, 4 per device
    results = autotune.measure(raw, 2, stages=(2,), remats=("full",))
    ranked = autotune.tune(raw, results, 2**30, steps=1)
    assert [r.candidate.micro for r in results] == [1, 2, 4] and all(r.status == "timed" for r in ranked)
    assert all(r.tokens_per_s > 0 for r in ranked)
