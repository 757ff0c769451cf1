"""AutoTP: which params a tensor group splits, and along which dimension, from their names.

DeepSpeed's AutoTP walks a torch model and splits each ``Linear``: "column" (its output
features; the next op gets a slice of the hidden) or "row" (its input features; the partial
sums are all-reduced after it). jzero does the same over param names (`jzero.zero.treepath`:
``blocks/stacked/qkv/kernel``) and hands the compiler the specs: a column leaf's last dimension
over "tensor", a row leaf's first (after a stacked-layer dimension). The compiler then places
Megatron's collectives: a column split followed by a row split (attention's qkv then proj, the
MLP's fc then out) is one all-reduce of the block's output, forward and backward.

    rule   | kernel ([..., in, out])  | bias ([..., out])  | Megatron name
    -------+--------------------------+--------------------+-------------------------------
    column | out over "tensor"        | over "tensor"      | ColumnParallelLinear
    row    | in over "tensor"         | replicated         | RowParallelLinear
    row    | (an embedding [V, d]: V) |                    | VocabParallelEmbedding
    skip   | replicated               | replicated         |

The first rule whose pattern finds a leaf's name wins; ``tensor_parallel.partition_config``
puts the user's rules before the built-in ones (``use_default_specs``, DeepSpeed's merge) or
instead of them. A built-in rule whose dimension the tensor size does not divide leaves the
leaf replicated; a user's rule says so as an error naming it.
"""
from __future__ import annotations

import re
import warnings
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from jzero.config import Config, ConfigError, ConfigWarning, TPLayerSpec
from jzero.zero import treepath
from jzero.zero.mesh import TENSOR
from jzero.zero.sharding import is_stacked

# The reference models' names (jzero.models.gpt / vit / clip) and the HF / Megatron names AutoTP's
# presets split: attention's input projections and the MLP's first are column, their outputs row.
_COLUMN = r"(^|/)(qkv|fc|up|head|q_proj|k_proj|v_proj|query|key|value|gate_proj|up_proj|c_attn|c_fc|wi|wi_0|wi_1|"\
          r"query_key_value|dense_h_to_4h|lm_head)/(kernel|bias)$"
_ROW = r"(^|/)(proj|out|down|o_proj|out_proj|down_proj|c_proj|wo|dense_4h_to_h)/kernel$"
_VOCAB = r"(^|/)(wte|embed_tokens|word_embeddings)/embedding$"
DEFAULT_SPECS = (TPLayerSpec((_COLUMN,), "column"), TPLayerSpec((_ROW, _VOCAB), "row"))


class Rule(NamedTuple):
    where: str  # the config key that holds it (in errors), or "" for a built-in rule
    patterns: tuple[re.Pattern, ...]
    kind: str


def rules(config: Config) -> list[Rule]:
    """The rules in the order they are tried; ConfigError naming a pattern that does not compile."""
    part = config.tensor_parallel.partition_config
    key = "tensor_parallel.partition_config.layer_specs"
    out = []
    for i, spec in enumerate(part.layer_specs):
        if not spec.patterns:
            raise ConfigError(f"{key}[{i}].patterns: give at least one regex")
        out.append(Rule(f"{key}[{i}]", tuple(_compiled(f"{key}[{i}].patterns", p) for p in spec.patterns),
                        spec.partition_type))
    if part.use_default_specs:
        out += [Rule("", tuple(re.compile(p) for p in s.patterns), s.partition_type) for s in DEFAULT_SPECS]
    return out


def _compiled(where: str, pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"{where}: {pattern!r} is not a regex ({e})") from None


def dim(kind: str, shape: tuple[int, ...], stacked: bool) -> int | None:
    """The dimension ``kind`` splits in a leaf of ``shape`` (None: replicated)."""
    first, rank = int(stacked), len(shape) - int(stacked)
    if kind == "column" and rank >= 1:
        return len(shape) - 1
    if kind == "row" and rank >= 2:
        return first
    return None


def leaf_spec(name: str, shape: tuple[int, ...], stacked: bool, tp: int, table: list[Rule]) -> P:
    """One leaf's spec over "tensor" by the first rule that finds its name (P(): none, or skip)."""
    rule = next((r for r in table if any(p.search(name) for p in r.patterns)), None)
    d = None if rule is None else dim(rule.kind, shape, stacked)
    if d is None:
        return P()
    if shape[d] % tp:
        if rule.where:
            raise ConfigError(f"{rule.where}: '{name}' is split {rule.kind}-wise along a dimension of {shape[d]}, "
                              f"which tensor_parallel.autotp_size {tp} does not divide")
        return P()
    return P(*([None] * d), TENSOR)


def model_specs(config: Config, params_shape: Any) -> Any | None:
    """The tree of tensor-parallel specs of ``params_shape`` (None without tensor parallelism);
    a warning when the rules split none of its leaves (every device would hold the whole model)."""
    tp = config.tensor_parallel.size
    if tp == 1:
        return None
    table = rules(config)
    specs = jax.tree_util.tree_map_with_path(
        lambda path, x: leaf_spec(treepath.SEP.join(map(treepath.key_name, path)), tuple(x.shape),
                                  is_stacked(path), tp, table), params_shape)
    if not split_leaves(specs):
        warnings.warn(f"tensor_parallel.autotp_size: {tp} splits no param (no leaf name matches a rule, or "
                      f"{tp} divides no matched dimension): every device holds the whole model; name the model's "
                      "layers in tensor_parallel.partition_config", ConfigWarning, stacklevel=2)
    return specs


def split_leaves(specs: Any) -> int:
    """How many leaves a tree of specs splits over "tensor"."""
    return sum(TENSOR in tuple(s) for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))
