"""A Hugging Face model directory's ``config.json`` as a jzero model spec.

``llama``, ``mistral``, ``qwen2`` and ``qwen3`` become a `jzero.models.llama.LlamaConfig`;
``gpt2`` the reference `jzero.models.gpt.GPTConfig` (learned positions, biases, gelu-tanh,
LayerNorm eps). Both spellings of transformers are read: 4.x's ``rope_theta`` / ``rope_scaling``
/ ``torch_dtype`` and 5.x's ``rope_parameters`` / ``dtype``. A model type, activation, RoPE type
or field value jzero does not implement is a one-line ConfigError naming it; nothing is guessed.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NamedTuple

from jzero.config import Config, ConfigError
from jzero.models import rope
from jzero.models.gpt import GPTConfig
from jzero.models.llama import LlamaConfig

LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")
FAMILY = {**{t: "llama" for t in LLAMA_TYPES}, "gpt2": "gpt"}
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# jzero.model keys a directory's config.json decides
SHAPE_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "positions", "tie_embeddings", "mlp_tile")


class Spec(NamedTuple):
    """What a directory says: jzero's model name and config, the weights' dtype, the raw config."""

    name: str
    model: Any
    dtype: str
    raw: dict


def read(directory: str | Path) -> dict:
    """``config.json`` of ``directory`` as a dict; ConfigError naming the path when absent or bad."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"jzero.model.hf: {path} not found (a Hugging Face model directory holds config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"jzero.model.hf: {path} is not JSON ({e})") from None


def spec(config: Config) -> Spec:
    """The spec of ``config``'s ``jzero.model.hf`` directory, its sequence length cut to
    ``jzero.model.seq_len`` when that is less, under ``jzero.remat`` and the model's attention settings."""
    section = config.jzero.model
    if section.hf is None:
        raise ConfigError("jzero.model.hf: the llama model is read from a Hugging Face directory; give one "
                          "(--hf DIR or jzero.model.hf)")
    for key in SHAPE_KEYS:
        if getattr(section, key) is not None:
            raise ConfigError(f"jzero.model.{key}: the Hugging Face directory {section.hf} sets the model's shape; "
                              f"remove it (only seq_len, attention and loss_tile may be given with hf)")
    out = from_dict(read(section.hf), seq_len=section.seq_len, remat=config.jzero.remat, attention=section.attention)
    if section.loss_tile is not None:
        out = out._replace(model=dataclasses.replace(out.model, loss_tile=section.loss_tile))
    return out


def from_dict(raw: dict, seq_len: int | None = None, remat: str = "full", attention: Any = None) -> Spec:
    """The spec of a parsed config.json (see `spec`)."""
    kind = raw.get("model_type")
    if kind not in FAMILY:
        raise ConfigError(f"config.json model_type: '{kind}' is not supported; supported: {', '.join(FAMILY)}")
    dtype = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if dtype not in DTYPES:
        raise ConfigError(f"config.json dtype: '{dtype}' is not supported; supported: {', '.join(DTYPES)}")
    model = _gpt2(raw) if kind == "gpt2" else _llama(raw, kind)
    longest = model.seq_len
    if seq_len is not None and seq_len > longest:
        raise ConfigError(f"jzero.model.seq_len: {seq_len} is longer than the model's context {longest} "
                          "(config.json max_position_embeddings / n_positions)")
    changes: dict[str, Any] = {"seq_len": min(seq_len or longest, longest), "remat": remat}
    if attention is not None:
        changes["attention"] = attention
    return Spec(FAMILY[kind], dataclasses.replace(model, **changes), DTYPES[dtype], raw)


def _need(raw: dict, key: str) -> Any:
    if key not in raw:
        raise ConfigError(f"config.json: '{key}' is missing")
    return raw[key]


def _refuse(raw: dict, key: str, allowed: Any, what: str) -> None:
    value = raw.get(key, allowed[0])
    if value not in allowed:
        raise ConfigError(f"config.json {key}: {value!r} is not supported ({what})")


def _rope(raw: dict) -> rope.RoPE:
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.pop("rope_type", params.pop("type", "default")) or "default"
    if kind not in rope.TYPES:
        raise ConfigError(f"config.json rope_type: '{kind}' is not supported; supported: {', '.join(rope.TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"config.json partial_rotary_factor: {params['partial_rotary_factor']} is not supported "
                          "(1.0: every feature rotates)")
    for key in rope.NEEDS.get(kind, ()):
        if params.get(key) is None:
            raise ConfigError(f"config.json rope_parameters.{key}: needed by rope_type '{kind}'")
    fields = {f.name for f in dataclasses.fields(rope.RoPE)}
    given = {k: v for k, v in params.items() if k in fields and v is not None}
    return rope.RoPE(theta=float(theta), type=kind, **given)


def _windows(raw: dict, kind: str, layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention); () when no layer slides."""
    window = raw.get("sliding_window")
    if kind in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None
    types = raw.get("layer_types")
    if types is not None:
        bad = sorted(set(types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ConfigError(f"config.json layer_types: {bad[0]!r} is not supported "
                              "(full_attention, sliding_attention)")
        if "sliding_attention" in types and not window:
            raise ConfigError("config.json sliding_window: layer_types name sliding_attention without a window")
        slides = [t == "sliding_attention" for t in types]
    elif window and kind in ("qwen2", "qwen3"):
        slides = [i >= raw.get("max_window_layers", layers) for i in range(layers)]
    else:
        slides = [bool(window)] * layers
    return tuple(int(window) if s else 0 for s in slides) if any(slides) else ()


def _llama(raw: dict, kind: str) -> LlamaConfig:
    _refuse(raw, "hidden_act", ("silu",), "the Llama family's SwiGLU uses silu")
    _refuse(raw, "mlp_bias", (False,), "no MLP biases in this family")
    _refuse(raw, "attention_bias", (kind == "qwen2",), "q/k/v biases are Qwen2's")
    hidden, heads = _need(raw, "hidden_size"), _need(raw, "num_attention_heads")
    layers = _need(raw, "num_hidden_layers")
    head_dim = raw.get("head_dim") or hidden // heads
    return LlamaConfig(
        vocab_size=_need(raw, "vocab_size"), seq_len=_need(raw, "max_position_embeddings"), d_model=hidden,
        n_layers=layers, n_heads=heads, n_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=head_dim,
        d_ff=_need(raw, "intermediate_size"), rms_eps=float(raw.get("rms_norm_eps", 1e-6)), rope=_rope(raw),
        qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3", windows=_windows(raw, kind, layers),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)))


def _gpt2(raw: dict) -> GPTConfig:
    _refuse(raw, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), "GPT-2's gelu is the tanh one")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        _refuse(raw, key, (False,), "the GPT-2 attention as published")
    width = _need(raw, "n_embd")
    return GPTConfig(vocab_size=_need(raw, "vocab_size"), seq_len=_need(raw, "n_positions"), d_model=width,
                     n_layers=_need(raw, "n_layer"), n_heads=_need(raw, "n_head"), d_ff=raw.get("n_inner") or 4 * width,
                     positions="learned", tie_embeddings=True, qkv_bias=True,
                     ln_eps=float(raw.get("layer_norm_epsilon", 1e-5)), positions_len=_need(raw, "n_positions"))
