"""Models: the reference models (`gpt`, `vit`, `clip`, `mlp`, `evoformer` on `base`) and what any model is
built with: `scan_layers` (`layers`), the MoE layer and its gates, `from_linen` / `from_nnx`
(`adapters`). Imports `jzero.config` and `jzero.zero`.

`build` turns a config into a `Model` by name (``jzero.model.name``): the one place a config
becomes (init_fn, loss_fn, batch shapes) for `jzero train`, estimate, autotune and profile;
the next reference models plug into `MODELS`.
"""
from __future__ import annotations

from collections.abc import Callable

from jzero.config import Config, ConfigError, unknown
from jzero.models import attention, clip, evoformer, gpt, hfconfig, llama, mlp, vit
from jzero.models.base import Model

MODELS: dict[str, Callable[[Config], Model]] = {"gpt": gpt.build, "vit": vit.build, "clip": clip.build,
                                              "mlp": mlp.build, "evoformer": evoformer.build, "llama": llama.build}
# a Hugging Face directory's family (`jzero.models.hfconfig`) -> its model from the spec it reads
FROM_SPEC: dict[str, Callable[[object], Model]] = {"gpt": gpt.build_from, "llama": llama.build_from}


def build(config: Config) -> Model:
    """The reference model the config's ``jzero.model`` section describes (checked, its split
    by tensor and sequence parallelism included)."""
    model = _reference(config)
    check_split(config, model.spec)
    windows = set(getattr(model.spec, "windows", ()))
    if config.pipeline.stages > 1 and len(windows) > 1:
        raise ConfigError(f"pipeline.stages: {config.pipeline.stages} needs every layer to attend alike; this "
                          f"model's layers have different sliding windows ({sorted(windows)}; 0 = full attention)")
    return model


def _reference(config: Config) -> Model:
    if config.jzero.model.hf is not None:
        spec = hfconfig.spec(config)
        return FROM_SPEC[spec.name](spec.model)
    name = config.jzero.model.name
    if name not in MODELS:
        raise unknown("jzero.model.name", f"model '{name}'", name, MODELS)
    return MODELS[name](config)


def validate(config: Config, named: bool = True) -> None:
    """ConfigError naming the ``jzero.model`` key that is wrong; builds nothing heavy. The split
    is checked against the reference model only when the config ``named`` one: a config without a
    ``jzero.model`` section may train the user's own model (`jzero.init`), which has no say in
    the reference GPT's heads; `build` checks it wherever the reference model is used."""
    if config.sparse_attention is not None and config.jzero.model.name != "gpt":
        raise ConfigError(f"sparse_attention: only the gpt model takes a sparse layout, not "
                          f"{config.jzero.model.name!r} (its sequence need not be whole blocks)")
    attention.check_settings(config.jzero.model.attention)
    model = _reference(config)
    if named:
        check_split(config, model.spec)


def check_split(config: Config, spec: object) -> None:
    """ConfigError naming the key when tensor or sequence parallelism cannot split the model:
    Ulysses needs token sequences (the GPT's), and each device takes whole heads."""
    tp, sp, name = config.tensor_parallel.size, config.sequence_parallel_size, config.jzero.model.name
    if sp > 1 and not hasattr(spec, "vocab_size"):
        raise ConfigError(f"sequence_parallel_size: {sp} splits token sequences; the {name!r} model has none "
                          "(language models only: gpt, llama, a Hugging Face directory)")
    heads = getattr(spec, "n_heads", None)
    if heads is not None and heads % tp:
        raise ConfigError(f"tensor_parallel.autotp_size: {tp} does not divide jzero.model.n_heads {heads} "
                          "(each device of a tensor group takes whole heads)")
    if heads is not None and heads % (tp * sp):
        raise ConfigError(f"sequence_parallel_size: {sp} x tensor_parallel.autotp_size {tp} does not divide "
                          f"jzero.model.n_heads {heads} (Ulysses gives each device whole heads)")
    split = sp * (tp if config.jzero.mesh.megatron_sequence_parallel else 1)
    seq_len = getattr(spec, "seq_len", None)
    if split > 1 and seq_len is not None and seq_len % split:
        raise ConfigError(f"sequence_parallel_size: the {split} token shards do not divide jzero.model.seq_len "
                          f"{seq_len}")


__all__ = ["MODELS", "Model", "build", "validate"]
