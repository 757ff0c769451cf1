"""DeepSpeed Sparse Attention: jzero's layouts equal DeepSpeed 0.19.6's own ``make_layout``
(tests/golden/sparse/layouts.json, recorded by tests/golden/sparse/record.py; the random
modes too, drawn in DeepSpeed's order from the same seed), the ds_config section is checked key
by key, and blockwise attention's compiled matmul FLOPs follow each layout's density."""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jzero
from jzero.analysis import profile
from jzero.models import attention as attn
from jzero.models.attention import layouts

GOLDEN = json.loads((Path(__file__).parent / "golden" / "sparse" / "layouts.json").read_text())


def _section(raw, seq_len=256):
    cfg = jzero.load_config({"train_batch_size": 8, "sparse_attention": raw,
                             "jzero": {"model": {"seq_len": seq_len}}})
    return cfg.sparse_attention


@pytest.mark.parametrize("name", GOLDEN["cases"])
def test_layout_equals_deepspeeds(name):
    case = GOLDEN["cases"][name]
    section = _section(case["section"], case["seq_len"])
    got = layouts.make_layout(section, case["heads"], case["seq_len"], case["seed"])
    np.testing.assert_array_equal(got, np.array(case["layout"]), err_msg=name)


def test_random_blocks_count_per_row_and_seed():
    section = _section({"mode": "variable", "num_random_blocks": 3, "local_window_blocks": [1],
                        "global_block_indices": [100]})
    lay = layouts.make_layout(section, 2, 256, seed=5)
    assert (lay[0].sum(1) - 1 <= 3).all() and (lay[0].sum(1) >= 1).all()  # 3 draws + the diagonal, may overlap
    assert not np.array_equal(lay, layouts.make_layout(section, 2, 256, seed=6))
    np.testing.assert_array_equal(lay, layouts.make_layout(section, 2, 256, seed=5))


@pytest.mark.parametrize("raw,match", [
    ({"mode": "fixed", "num_sliding_window_blocks": 3}, "sparse_attention.num_sliding_window_blocks: not a key of "
                                                        "mode 'fixed'"),
    ({"mode": "fixed", "num_local_blocks": 3, "num_global_blocks": 2}, "sparse_attention.num_local_blocks"),
    ({"mode": "fixed", "attention": "unidirectional", "horizontal_global_attention": True},
     "sparse_attention.horizontal_global_attention"),
    ({"mode": "variable", "global_block_indices": [0, 4], "global_block_end_indices": [2]},
     "sparse_attention.global_block_end_indices"),
    ({"mode": "dense", "block": 48}, "sparse_attention.block: 48 does not divide the sequence length 64"),
    ({"mode": "sparse"}, "sparse_attention.mode"),
])
def test_bad_sections_are_one_line_errors(raw, match):
    with pytest.raises(jzero.ConfigError, match=match):
        jzero.load_config({"train_batch_size": 8, "sparse_attention": raw})


MODES_AT_4096 = {
    "dense": {"mode": "dense"},
    "fixed": {"mode": "fixed", "horizontal_global_attention": True},  # global rows with every block
    "variable": {"mode": "variable", "num_random_blocks": 2, "global_block_indices": [0, 100]},
    "bigbird": {"mode": "bigbird", "num_random_blocks": 2},
    "bslongformer": {"mode": "bslongformer", "global_block_indices": [0, 64, 128]},
}


@pytest.fixture(scope="module")
def flops_at_4096():
    """Compiled matmul FLOPs (forward + backward, loop trip counts included) of blockwise attention
    at T = 4096 under each mode's layout, with the layout's density."""
    t, heads = 4096, 2
    q = jax.ShapeDtypeStruct((1, t, heads, 16), jnp.float32)
    out = {}
    for mode, raw in MODES_AT_4096.items():
        layout = layouts.make_layout(_section(raw, seq_len=t), heads, t)

        def loss(q, k, v, layout=layout):
            return jnp.sum(attn.attention(q, k, v, layout=layout, implementation="blockwise"))

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile()
        out[mode] = (profile.flops(compiled), layouts.density(layout))
    return out


@pytest.mark.parametrize("mode", [m for m in MODES_AT_4096 if m != "dense"])
def test_compiled_flops_follow_the_layout_density(flops_at_4096, mode):
    dense_flops, _ = flops_at_4096["dense"]
    flops, density = flops_at_4096[mode]
    assert density < 0.5
    assert abs(flops / dense_flops / density - 1) <= 0.10, (mode, flops / dense_flops, density)


def test_analytic_flops_count_only_the_layouts_blocks():
    """The GPT's analytic FLOPs (`jzero profile`, the train summary's TFLOPs) count a sparse
    layout's attention at its density; the dense part is unchanged."""
    from jzero.models import gpt

    dense = gpt.GPTConfig(seq_len=256)
    sparse = gpt.GPTConfig(seq_len=256, sparse_attention=_section({"mode": "bigbird", "block": 16}))
    density = gpt.attention_density(sparse)
    assert 0 < density < 0.5
    want, got = gpt.model_flops(dense, 1024), gpt.model_flops(sparse, 1024)
    assert got["dense"] == want["dense"]
    assert got["attention"] == pytest.approx(want["attention"] * density, rel=1e-12)
