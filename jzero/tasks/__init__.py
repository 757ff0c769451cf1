"""Tasks: a reference model with its data. `Task` (here), data (`text`, `images`, `protein` and its
`protein_metrics`): global batches as a pure function of seed, split and step, held-out metrics, a
preview. Imports config, zero, models, train and inference.

One task per reference model (`TASKS`, keyed by ``jzero.model.name``): language modelling for
the GPT, image classification for the ViT and the MLP, contrastive image-text training for CLIP,
secondary structure and distograms for the Evoformer. The engine and the CLI see only `Task`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from jzero import models
from jzero.config import Config, ConfigError
from jzero.inference import engine, scheduler, uncached
from jzero.inference import text as wording
from jzero.models import clip, evoformer, lora
from jzero.tasks import images, packer, protein, protein_metrics, records, text, tokencache
from jzero.train.state import TrainState, device_params

SAMPLE_PROMPT = "def "
SAMPLE_TOKENS = 160
PREVIEW = 16  # held-out examples a vision preview shows


@dataclass(frozen=True)
class Task:
    """``batch(split, step, batch_size, sharding)``: a global batch; ``evaluate(state)``: the
    task's held-out metrics (named ``metrics``), besides the held-out loss every task has;
    ``preview(state)``: a few lines showing what the model does (``preview_title`` names them)."""

    model: models.Model
    describe: str
    batch: Callable[[str, int, int, NamedSharding], dict]
    evaluate: Callable[[TrainState], dict[str, float]]
    preview: Callable[[TrainState], str]
    preview_title: str
    metrics: tuple[str, ...] = ()


def build(config: Config) -> Task:
    """The task of the config's model (``jzero.model.name``), with its data loaded and checked."""
    model = models.build(config)
    return TASKS[model.name](config, model)


def language(config: Config, model: models.Model) -> Task:
    hf, data = config.jzero.model.hf, config.jzero.data
    tokenizer = wording.for_model(model.spec.vocab_size, hf)
    cfg = model.spec
    if data.path is not None and records.is_records(data.path):
        batch, described = _records_batches(config, model, tokenizer)
    else:
        corpus = text.load_corpus(data, tokenizer if hf else None)
        if corpus.vocab_size > cfg.vocab_size:
            raise ConfigError(f"jzero.model.vocab_size: {cfg.vocab_size} is smaller than the data's "
                              f"vocabulary ({corpus.vocab_size} in {corpus.source})")
        described = text.describe(corpus)

        def batch(split: str, step: int, batch_size: int, sharding: NamedSharding) -> dict:
            tokens = corpus.train if split == "train" else corpus.heldout
            return text.global_batch(tokens, config.seed, split, step, batch_size, cfg.seq_len, sharding)

    prompt = tokenizer.encode(SAMPLE_PROMPT) if tokenizer.text else list(SAMPLE_PROMPT.encode())

    def preview(state: TrainState) -> str:
        tokens = _sample(model, _params(state), prompt, config.seed)
        if not tokenizer.text:
            return " ".join(map(str, tokens))
        return SAMPLE_PROMPT + tokenizer.decode(tokens)

    return Task(model, described, batch, lambda state: {}, preview, "sample (temperature 0.8)")


def _records_batches(config: Config, model: models.Model, tokenizer: Any) -> tuple[Callable, str]:
    """Fine-tuning records (`records`): tokenized through the cache, split by documents, packed."""
    data, seq_len = config.jzero.data, model.spec.seq_len
    if not tokenizer.text:
        raise ConfigError(f"jzero.data.path: {data.path} holds text records, and this model (vocab "
                          f"{model.spec.vocab_size}) has no tokenizer: give jzero.model.hf a directory with one")
    tokens = tokencache.load(data.path, data, tokenizer)
    tokencache.check_vocab(tokens, model.spec.vocab_size, data.path)
    tokencache.check_trained(tokens, data.path)
    splits = dict(zip(("train", "heldout"), packer.split(tokens, data.heldout_fraction), strict=True))
    plans = {name: packer.plan(part.starts, seq_len, data.packing) for name, part in splits.items()}

    def batch(split: str, step: int, batch_size: int, sharding: NamedSharding) -> dict:
        return packer.global_batch(splits[split], plans[split], config.seed, split, step, batch_size, sharding)

    described = (f"{data.path}: {len(splits['train']):,} train / {len(splits['heldout']):,} held-out documents, "
                 f"{plans['train'].rows:,} + {plans['heldout'].rows:,} rows of {seq_len} "
                 f"({'packed' if data.packing else 'padded'}; {tokens.source})")
    return batch, described


def _params(state: TrainState) -> Any:
    """The state's params as the forward and the decoder take them: device memory, adapters merged."""
    return lora.for_inference(device_params(state), state.config.jzero.lora)


def _sample(model: models.Model, params: Any, prompt: list[int], seed: int) -> list[int]:
    """The preview's tokens after ``prompt``: from the KV-cached engine up to `SAMPLE_TOKENS`
    or the end of the model's context; a GPT it cannot serve (MoE, sparse) re-runs the forward
    per token over a sliding window (`jzero.inference.uncached`)."""
    cfg = model.spec
    if model.decoder is not None:
        if jax.process_count() > 1:  # the engine is each process's own: every process gets the whole params
            params = multihost_utils.process_allgather(params, tiled=True)
        request = scheduler.Request(prompt, min(SAMPLE_TOKENS, cfg.seq_len - len(prompt) + 1), uncached.PREVIEW,
                                    seed=seed)
        return list(scheduler.stream(engine.Engine(model.decoder, params, slots=1), request))
    prompt = jnp.asarray(prompt, jnp.int32)
    return jax.device_get(uncached.generate(cfg, params, prompt, SAMPLE_TOKENS, jax.random.key(seed))).tolist()


def _images(config: Config, cfg: Any) -> images.Images:
    found = images.load_images(config.jzero.data)
    h, w, c = found.train.shape[1:]
    if (h, w, c) != (cfg.image_size, cfg.image_size, cfg.channels):
        raise ConfigError(f"jzero.model.image_size / channels: the model takes {cfg.image_size}x{cfg.image_size}x"
                          f"{cfg.channels} images, {found.source} has {h}x{w}x{c}")
    return found


def classification(config: Config, model: models.Model) -> Task:
    cfg = model.spec
    found = _images(config, cfg)
    if len(found.class_names) > cfg.num_classes:
        raise ConfigError(f"jzero.model.num_classes: {cfg.num_classes}, but {found.source} has "
                          f"{len(found.class_names)} classes")

    def predict(state: TrainState) -> np.ndarray:
        return np.asarray(jnp.argmax(model.forward(_params(state), found.heldout), axis=-1))

    def evaluate(state: TrainState) -> dict[str, float]:
        return {"eval_accuracy": float(np.mean(predict(state) == found.heldout_labels))}

    def preview(state: TrainState) -> str:
        pred, true = predict(state)[:PREVIEW], found.heldout_labels[:PREVIEW]
        return (f"predicted {' '.join(found.class_names[i] for i in pred)}\n"
                f"true      {' '.join(found.class_names[i] for i in true)}")

    def batch(split: str, step: int, size: int, sharding: NamedSharding) -> dict:
        return images.global_batch(found, config.seed, split, step, size, sharding)

    return Task(model, images.describe(found), batch, evaluate, preview, f"held-out predictions (first {PREVIEW})",
                ("eval_accuracy",))


def contrastive(config: Config, model: models.Model) -> Task:
    cfg = model.spec
    found = _images(config, cfg)
    module = clip.CLIP(cfg)
    encode_image = jax.jit(lambda p, x: module.apply({"params": p}, x, method=clip.CLIP.encode_image))
    encode_text = jax.jit(lambda p, t: module.apply({"params": p}, t, method=clip.CLIP.encode_text))
    names = found.class_names

    def texts(strings: list[str]) -> np.ndarray:
        return np.stack([images.encode_text(s, cfg.text_len) for s in strings])

    def zero_shot(params: Any, img: np.ndarray) -> np.ndarray:
        """Class scores: each class's prompts (every template) embedded, averaged, renormalised."""
        prompts = texts([images.caption(n, t) for n in names for t in range(len(images.TEMPLATES))])
        classes = np.asarray(encode_text(params, prompts)).reshape(len(names), len(images.TEMPLATES), -1).mean(1)
        classes /= np.linalg.norm(classes, axis=-1, keepdims=True)
        return img @ classes.T

    def evaluate(state: TrainState) -> dict[str, float]:
        params = _params(state)
        img = np.asarray(encode_image(params, found.heldout))
        labels = found.heldout_labels
        captions = texts([images.caption(names[y], i) for i, y in enumerate(labels)])
        sim = img @ np.asarray(encode_text(params, captions)).T
        # Captions of one class can coincide, so a retrieval counts when its class is right.
        return {"zeroshot_accuracy": float(np.mean(zero_shot(params, img).argmax(1) == labels)),
                "i2t_recall1": float(np.mean(labels[sim.argmax(1)] == labels)),
                "t2i_recall1": float(np.mean(labels[sim.argmax(0)] == labels))}

    def preview(state: TrainState) -> str:
        params = _params(state)
        img = np.asarray(encode_image(params, found.heldout[:PREVIEW]))
        pred, true = zero_shot(params, img).argmax(1), found.heldout_labels[:PREVIEW]
        return (f"zero-shot {' '.join(names[i] for i in pred)}\n"
                f"true      {' '.join(names[i] for i in true)}")

    def batch(split: str, step: int, size: int, sharding: NamedSharding) -> dict:
        return images.global_batch(found, config.seed, split, step, size, sharding, text_len=cfg.text_len)

    return Task(model, images.describe(found), batch, evaluate, preview,
                f"zero-shot held-out predictions (first {PREVIEW})",
                ("zeroshot_accuracy", "i2t_recall1", "t2i_recall1"))


def structure(config: Config, model: models.Model) -> Task:
    """The Evoformer on proteins (`protein`): Q8 secondary structure and the distogram, held-out
    metrics (`protein_metrics`) next to their baselines from the training chains."""
    cfg, data = model.spec, protein.load(config.jzero.data)
    held = {kind: [w for chain in chains[:EVAL_CHAINS] for w in protein.windows(chain, cfg.crop)]
            for kind, chains in (("sequences", data.sequences["heldout"]), ("structures", data.structures["heldout"]))}
    prior = protein.separation_prior(data.structures["train"], cfg.crop)
    arrays = {kind: protein.stack(crops, prior) for kind, crops in held.items()}
    baselines = {**protein_metrics.majority(data.sequences["train"], arrays["sequences"]["ss8"]),
                 **protein_metrics.separation_baseline(prior, arrays["structures"]["distogram"])}

    def predict(state: TrainState, batch: dict) -> tuple[np.ndarray, np.ndarray]:
        params, n = _params(state), len(batch["residues"])
        outs = []
        for i in range(0, n, EVAL_BATCH):
            rows = {k: np.resize(v[i:i + EVAL_BATCH], (EVAL_BATCH, *v.shape[1:])) for k, v in batch.items()}
            outs.append(jax.device_get(model.forward(params, evoformer.inputs(rows))))
        return tuple(np.concatenate([o[k] for o in outs])[:n] for k in (0, 1))

    def evaluate(state: TrainState) -> dict[str, float]:
        ss, _ = predict(state, arrays["sequences"])
        _, dist = predict(state, arrays["structures"])
        return {**protein_metrics.secondary_structure(ss, arrays["sequences"]["ss8"]),
                **protein_metrics.distogram(dist, arrays["structures"]["distogram"]), **baselines}

    def preview(state: TrainState) -> str:
        first = {k: v[:1] for k, v in arrays["sequences"].items()}
        ss, n = predict(state, first)[0][0], int(first["mask"].sum())
        q3 = protein_metrics.q3_classes(ss)
        return (f"sequence  {''.join((protein.RESIDUES + 'X')[r] for r in first['residues'][0, :n])}\n"
                f"true      {''.join('HEC'[protein.Q3_OF_Q8[s]] for s in first['ss8'][0, :n])}\n"
                f"predicted {''.join('HEC'[c] for c in q3[:n])}")

    def batch(split: str, step: int, size: int, sharding: NamedSharding) -> dict:
        return protein.global_batch(data, config.seed, split, step, size, cfg.crop, prior, sharding)

    return Task(model, protein.describe(data), batch, evaluate, preview,
                f"held-out secondary structure (H helix, E strand, C coil; {data.sequences['heldout'][0].name})",
                PROTEIN_METRICS)


EVAL_CHAINS, EVAL_BATCH = 64, 16  # held-out sequence chains evaluated (all held-out structures are); forward batch
PROTEIN_METRICS = ("q3_accuracy", "q3_majority", "q8_accuracy", "q8_majority", "distogram_loss",
                   "distogram_loss_separation", "contact_precision_l5", "contact_precision_l5_separation")
TASKS: dict[str, Callable[[Config, models.Model], Task]] = {
    "gpt": language, "llama": language, "vit": classification, "mlp": classification, "clip": contrastive,
    "evoformer": structure}
