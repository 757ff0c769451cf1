"""Record DeepSpeed Sparse Attention's block layouts for tests/test_sparse_layouts.py.

Each case is a ds_config ``sparse_attention`` section: DeepSpeed's own config parser
(``deepspeed.runtime.config.get_sparse_attention``) resolves its defaults, the mode's
``SparsityConfig`` class is built from them (plus ``attention``, which the parser drops for
bigbird and bslongformer although their classes take it), and ``make_layout(seq_len)`` runs
after ``random.seed(seed)``. DeepSpeed removed Sparse Attention after 0.19.6 (0.19.8's
config parser refuses the section: "DeepSpeed Sparse Attention has been removed"), so the layouts
come from 0.19.6, on torch's CPU wheel (shared/REFERENCES.md, with
``deepspeed==0.19.6``):

    python tests/golden/sparse/record.py tests/golden/sparse/layouts.json
"""
import json
import random
import sys

import deepspeed
from deepspeed.ops.sparse_attention import sparsity_config as sc
from deepspeed.runtime.config import get_sparse_attention

CLASSES = {"dense": sc.DenseSparsityConfig, "fixed": sc.FixedSparsityConfig,
           "variable": sc.VariableSparsityConfig, "bigbird": sc.BigBirdSparsityConfig,
           "bslongformer": sc.BSLongformerSparsityConfig}

# (name, section, heads, seq_len, seed): three or more per mode, odd lengths included (a short
# last local window), the random modes with several seeds.
CASES = [
    ("dense-16", {"mode": "dense"}, 2, 128, 0),
    ("dense-8", {"mode": "dense", "block": 8}, 2, 64, 0),
    ("dense-32", {"mode": "dense", "block": 32}, 1, 256, 0),
    ("fixed-default", {"mode": "fixed"}, 4, 256, 0),
    ("fixed-uni", {"mode": "fixed", "num_local_blocks": 4, "num_global_blocks": 2, "attention": "unidirectional"},
     2, 16 * 13, 0),
    ("fixed-per-head", {"mode": "fixed", "different_layout_per_head": True, "num_different_global_patterns": 2,
                        "horizontal_global_attention": True, "num_local_blocks": 4, "num_global_blocks": 2},
     4, 16 * 14, 0),
    ("variable-default", {"mode": "variable"}, 2, 256, 0),
    ("variable-windows", {"mode": "variable", "local_window_blocks": [2, 3], "global_block_indices": [0, 5],
                          "attention": "unidirectional"}, 2, 16 * 15, 0),
    ("variable-ranges", {"mode": "variable", "global_block_indices": [1, 6], "global_block_end_indices": [3, 8],
                         "horizontal_global_attention": True, "different_layout_per_head": True}, 3, 256, 0),
    ("variable-random", {"mode": "variable", "num_random_blocks": 2, "different_layout_per_head": True}, 3, 256, 1),
    ("bigbird-default", {"mode": "bigbird"}, 2, 256, 0),
    ("bigbird-uni", {"mode": "bigbird", "num_sliding_window_blocks": 5, "num_global_blocks": 2,
                     "attention": "unidirectional"}, 2, 256, 0),
    ("bigbird-random", {"mode": "bigbird", "num_random_blocks": 2, "different_layout_per_head": True}, 3, 256, 2),
    ("bigbird-random-uni", {"mode": "bigbird", "num_random_blocks": 1, "attention": "unidirectional"}, 2, 256, 3),
    ("bslongformer-default", {"mode": "bslongformer"}, 2, 256, 0),
    ("bslongformer-wide", {"mode": "bslongformer", "num_sliding_window_blocks": 5, "global_block_indices": [0, 7]},
     2, 16 * 13, 0),
    ("bslongformer-ranges", {"mode": "bslongformer", "global_block_indices": [2], "global_block_end_indices": [4],
                             "attention": "unidirectional", "different_layout_per_head": True}, 2, 256, 0),
]


def record(section, heads, seq_len, seed):
    kwargs = dict(get_sparse_attention({"sparse_attention": section}))
    mode = kwargs.pop("mode")
    if "attention" in section:
        kwargs["attention"] = section["attention"]
    random.seed(seed)
    return CLASSES[mode](num_heads=heads, **kwargs).make_layout(seq_len).tolist()


if __name__ == "__main__":
    golden = {"deepspeed": deepspeed.__version__, "cases": {
        name: {"section": section, "heads": heads, "seq_len": seq_len, "seed": seed,
               "layout": record(section, heads, seq_len, seed)}
        for name, section, heads, seq_len, seed in CASES}}
    with open(sys.argv[1], "w") as f:
        json.dump(golden, f, separators=(",", ":"))
