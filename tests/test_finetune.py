"""Fine-tuning data (issue 51): records -> token cache -> packed rows with loss masks, and the
models trained on them. Packed rows must equal their documents run one by one; masked tokens
must not train; the loss must be one big batch's however the step splits it."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jzero
from jzero.config import AttentionConfig, ConfigError, DataConfig
from jzero.inference.text import Bytes
from jzero.models import gpt, llama, packing
from jzero.tasks import packer, records, tokencache

from helpers import EPS, LR, WD, assert_params_close, config

SEQ = 32
GPT = gpt.GPTConfig(seq_len=SEQ, d_model=32, n_heads=4, d_ff=64, remat="none")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def arithmetic(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt": f"{a}+{b}=", "completion": f"{a + b}"} for a, b in rng.integers(0, 999, (n, 2))]


def grads_of(loss_fn, params, batch):
    return jax.value_and_grad(lambda p: loss_fn(p, batch, jax.random.key(1)))(params)


def rows_of(tokens, layout):
    return packer.rows(tokens, layout, np.arange(layout.rows))


def with_weights(batch):
    """The batch with its weights normalized over it (what global_batch does)."""
    return {**batch, "weights": np.asarray(packing.normalized(jnp.asarray(batch["weights"])))}


MODELS = {
    "gpt-learned-naive": lambda: gpt.make(dataclasses.replace(GPT, attention=AttentionConfig(implementation="naive"))),
    "gpt-learned-blockwise": lambda: gpt.make(dataclasses.replace(
        GPT, attention=AttentionConfig(implementation="blockwise", block_q=8, block_k=8))),
    "gpt-rotary-blockwise": lambda: gpt.make(dataclasses.replace(
        GPT, positions="rotary", attention=AttentionConfig(implementation="blockwise", block_q=8, block_k=8))),
    "llama-rope-naive": lambda: llama.make(llama.LlamaConfig(seq_len=SEQ, remat="none")),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_rows_equal_documents_one_by_one(name):
    """Five documents, one longer than a row (cut in two, its tail starting the next row), packed
    into rows with padding: the loss and every gradient equal each document run alone, weighted
    by its tokens (rtol 1e-5). Negative control: the same rows without segments and positions
    (documents attending across, positions running on) differ."""
    init_fn, loss_fn = MODELS[name]()
    params = init_fn(jax.random.key(0))
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 256, n).astype(np.int32) for n in (9, 20, 45, 6, 14)]
    starts = np.cumsum([0] + [len(d) for d in docs])
    tokens = tokencache.Tokens(np.concatenate(docs), np.ones(starts[-1], np.uint8), starts, "test")
    layout = packer.plan(starts, SEQ)
    # 45 tokens: 32 pairs fill row 1, the tail's 12 start row 2 and two documents join it
    assert (layout.pairs == [8, 19, 32, 12, 5, 13]).all() and (layout.row == [0, 0, 1, 2, 2, 2]).all()
    batch = with_weights(rows_of(tokens, layout))
    loss, grads = grads_of(loss_fn, params, batch)

    pieces = [d for d in docs if len(d) <= SEQ + 1] + [docs[2][:SEQ + 1], docs[2][SEQ:]]
    total = sum(len(p) - 1 for p in pieces)
    want_loss, want = 0.0, jax.tree.map(jnp.zeros_like, params)
    for piece in pieces:
        one = {"inputs": piece[None, :-1], "targets": piece[None, 1:]}
        value, g = grads_of(loss_fn, params, one)
        share = (len(piece) - 1) / total
        want_loss += float(value) * share
        want = jax.tree.map(lambda a, b, s=share: a + s * b, want, g)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(expected))))
    unpacked = {k: v for k, v in batch.items() if k not in ("segments", "positions")}
    assert abs(float(grads_of(loss_fn, params, unpacked)[0]) - want_loss) > 1e-4


def test_plan_keeps_every_target_once():
    """Packing loses no (input, target) pair and invents none: the rows' weighted targets are
    the documents' targets, the long one's tail included; without packing each piece has a row."""
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, 256, n).astype(np.int32) for n in (3, 70, 1, 33, 34, 2)]
    starts = np.cumsum([0] + [len(d) for d in docs])
    tokens = tokencache.Tokens(np.concatenate(docs), np.ones(starts[-1], np.uint8), starts, "test")
    for pack in (True, False):
        layout = packer.plan(starts, SEQ, pack)
        batch = rows_of(tokens, layout)
        kept = batch["weights"] > 0
        got = sorted(zip(batch["inputs"][kept].tolist(), batch["targets"][kept].tolist(), strict=True))
        want = sorted((int(a), int(b)) for d in docs for a, b in zip(d[:-1], d[1:], strict=False))
        assert got == want
        assert (batch["positions"][batch["segments"] == 0] == 0).all()
    assert packer.plan(starts, SEQ, False).rows == len(packer.plan(starts, SEQ, False).row)


def bytes_tokens(tmp_path, rows, **data):
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    return tokencache.load(path, DataConfig(path=str(path), **data), Bytes()), path


def test_completion_only_loss_equals_hand_computed(tmp_path):
    """A prompt/completion file, packed: the loss is the mean cross entropy of the completions'
    tokens (and the end), computed here from the model's logits of each record alone; masked
    tokens get no gradient (changing their targets changes nothing)."""
    recs = arithmetic(12)
    tokens, _ = bytes_tokens(tmp_path, recs)
    init_fn, loss_fn = gpt.make(GPT)
    params = init_fn(jax.random.key(0))
    batch = with_weights(rows_of(tokens, packer.plan(tokens.starts, SEQ)))
    forward = gpt.GPT(dataclasses.replace(GPT, loss_tile=0))
    total, count = 0.0, 0
    for r in recs:
        prompt, completion = r["prompt"].encode(), r["completion"].encode()
        ids = np.frombuffer(prompt + completion, np.uint8).astype(np.int32)  # byte-level: no EOS
        logits = forward.apply({"params": params}, ids[None, :-1])[0]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, ids[1:])
        total += float(jnp.sum(ce[len(prompt) - 1:]))
        count += len(completion)
    loss, grads = grads_of(loss_fn, params, batch)
    np.testing.assert_allclose(float(loss), total / count, rtol=1e-5)
    masked = batch["weights"] == 0
    scrambled = {**batch, "targets": np.where(masked, (batch["targets"] + 7) % 256, batch["targets"])}
    loss2, grads2 = grads_of(loss_fn, params, scrambled)
    assert float(loss2) == float(loss)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), grads, grads2)


def test_zero3_accumulation_equals_one_big_batch(devices, tmp_path):
    """Rows with different numbers of trained tokens: ZeRO-3 on 8 devices with 2 micro-batches
    (full remat: the layers' backward recomputes them from the packed segments) trains as the
    plain optax loop on one device over the whole batch, whose loss is
    sum(w x ce) / sum(w) of raw weights (losses rtol 1e-5, params after 4 steps)."""
    tokens, _ = bytes_tokens(tmp_path, arithmetic(200, seed=3))
    layout = packer.plan(tokens.starts, SEQ)
    init_fn, loss_fn = gpt.make(dataclasses.replace(GPT, remat="full"))  # the recompute sees the segments too
    cfg = config(3, 2, batch=16, dp_size=8)
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=jax.random.key(0), mesh=jzero.make_mesh(cfg))
    tx = optax.adamw(LR, eps=EPS, weight_decay=WD)
    params = jax.jit(init_fn)(jax.random.key(0))
    opt_state = tx.init(params)

    def big_batch_loss(p, b):
        w = b["weights"]
        logits = gpt.GPT(dataclasses.replace(GPT, loss_tile=0)).apply({"params": p}, packing.Text(
            b["inputs"], None, None, packing.Packed(b["segments"], b["positions"])))
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"])
        return jnp.sum(ce * w) / jnp.sum(w)

    @jax.jit
    def plain(params, opt_state, b):
        value, g = jax.value_and_grad(big_batch_loss)(params, b)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    for s in range(4):
        raw = packer.rows(tokens, layout, packer.row_ids(layout, 0, "train", s, 16))
        assert len(set(raw["weights"].sum(axis=1).tolist())) > 1
        batch = packer.global_batch(tokens, layout, 0, "train", s, 16, state.plan.batch)
        state, metrics = jzero.train_step(state, batch)
        params, opt_state, want = plain(params, opt_state, raw)
        np.testing.assert_allclose(float(metrics["loss"]), float(want), rtol=1e-5)
    jax.tree.map(assert_params_close, jax.device_get(state.params), jax.device_get(params))


def test_token_cache_reused_and_rebuilt(tmp_path):
    """The second load maps the cache; a changed file or tokenizer setting rebuilds it, and the
    old entry is gone."""
    recs = arithmetic(5)
    first, path = bytes_tokens(tmp_path, recs)
    assert first.source == "tokenized"
    again = tokencache.load(path, DataConfig(path=str(path)), Bytes())
    assert again.source.startswith("token cache") and np.array_equal(again.tokens, first.tokens)
    changed, _ = bytes_tokens(tmp_path, recs + arithmetic(1, seed=9))
    assert changed.source == "tokenized" and len(changed) == 6
    masks, _ = bytes_tokens(tmp_path, recs + arithmetic(1, seed=9), completion_only_loss=False)
    assert masks.source == "tokenized" and masks.mask.all()
    assert len(list(tokencache.folder(path).iterdir())) == 1


@pytest.mark.parametrize("rows, message", [
    ([{"text": "a"}, {"txt": "b"}], "data.jsonl row 2: no field 'messages' or 'prompt'+'completion' or 'text'"),
    ([{"messages": [{"role": "wizard", "content": "hi"}]}], "row 1: field 'messages'[0]: unknown role 'wizard'"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "row 1: chat messages need the tokenizer's chat template"),
    ([{"prompt": "a", "completion": 3}], "row 1: field 'completion' must be a str, got int"),
    ([], "data.jsonl is empty"),
    ([{"prompt": "1+1=", "completion": ""}] * 3, "data.jsonl: no token is trained on"),
])
def test_bad_records_name_file_row_and_field(tmp_path, rows, message):
    with pytest.raises(ConfigError, match="jzero.data.path: .*" + message.replace("+", r"\+").replace("[", r"\[")
                       .replace("(", r"\(")):
        tokens, path = bytes_tokens(tmp_path, rows)
        tokencache.check_trained(tokens, str(path))


def test_records_are_found_by_suffix_in_any_case_and_must_be_utf8(tmp_path):
    """DATA.JSONL is records, not raw text; a row that is not UTF-8 is named, not a traceback."""
    upper = write_jsonl(tmp_path / "DATA.JSONL", arithmetic(3))
    assert records.is_records(upper) and len(tokencache.build(upper, DataConfig(), Bytes())) == 3
    upper.write_bytes(b'{"text": "ok"}\n\xff\xfe{"text": "bad"}\n')
    with pytest.raises(ConfigError, match=r"DATA.JSONL row 2: not UTF-8 \(byte 0 of the row\)"):
        tokencache.build(upper, DataConfig(), Bytes())


def test_parquet_column_of_the_wrong_type(tmp_path):
    """A Parquet file reads as JSON lines do; a column of the wrong type is named with its row."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "completion": ["2", "4"]}), good)
    tokens = tokencache.build(good, DataConfig(), Bytes())
    assert len(tokens) == 2 and tokens.mask.sum() == 2
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), bad)
    with pytest.raises(ConfigError, match=r"bad.parquet row 1: field 'text' must be a str, got int"):
        tokencache.build(bad, DataConfig(), Bytes())
    assert records.is_records(tmp_path)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    """examples/hf_tiny_llama.py's BPE tokenizer with its ChatML template."""
    pytest.importorskip("tokenizers")
    from test_examples import load_example

    from jzero.inference.text import HF
    out = tmp_path_factory.mktemp("chatml")
    load_example("hf_tiny_llama").write_tokenizer(out, 400)
    return HF(out)


def test_assistant_only_mask_is_the_assistant_turns(tmp_path, chatml):
    """Chats rendered with the template: the trained tokens spell exactly the assistant turns'
    contents and their end-of-turn markers (the EOS after the last turn too); with the flag off
    every token trains."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "It is 6."}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}])
    doc = next(records.documents(path, DataConfig(), chatml))
    trained = chatml.tokenizer.decode(doc.tokens[doc.mask == 1].tolist(), skip_special_tokens=False)
    assert trained == "4<|im_end|>\nIt is 6.<|im_end|>\n<|endoftext|>"
    assert chatml.tokenizer.decode(doc.tokens.tolist(), skip_special_tokens=False) == chatml.chat(chat, False) + \
        "<|endoftext|>"
    assert next(records.documents(path, DataConfig(assistant_only_loss=False), chatml)).mask.all()


def test_conversational_prompt_completion_trains_the_completion(tmp_path, chatml):
    """TRL's conversational prompt-completion: the completion-only tokens are what the template
    adds after the generation prompt (the answer and its end-of-turn marker)."""
    rows = [{"prompt": [{"role": "user", "content": "def f(x):\n    \"\"\"Twice x.\"\"\""}],
             "completion": [{"role": "assistant", "content": "    return 2 * x"}]}]
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    doc = next(records.documents(path, DataConfig(), chatml))
    trained = chatml.tokenizer.decode(doc.tokens[doc.mask == 1].tolist(), skip_special_tokens=False)
    assert trained == "    return 2 * x<|im_end|>\n<|endoftext|>"
    write_jsonl(path, [{"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}])
    with pytest.raises(ConfigError, match="row 1: field 'prompt' is a string and 'completion' a list"):
        next(records.documents(path, DataConfig(), chatml))


def test_pipeline_trains_packed_rows_as_without_one(devices, tmp_path):
    """Two pipeline stages (each chunk given its micro-batch's segments and positions, full remat)
    train packed prompt/completion rows as the same model without a pipeline (losses rtol 1e-5)."""
    tokens, _ = bytes_tokens(tmp_path, arithmetic(200, seed=4))
    layout = packer.plan(tokens.starts, SEQ)
    model = dataclasses.replace(GPT, remat="full", n_layers=4)
    init_fn, loss_fn = gpt.make(model)
    losses = {}
    for p in (1, 2):
        cfg = jzero.load_config({
            "train_batch_size": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "eps": EPS}},
            "pipeline": {"stages": p}, "jzero": {"mesh": {"devices": 4}}})
        state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=jax.random.key(0), stages=gpt.stages(model))
        losses[p] = []
        for s in range(3):
            batch = packer.global_batch(tokens, layout, 0, "train", s, 8, state.plan.batch)
            state, metrics = jzero.train_step(state, batch)
            losses[p].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[2], losses[1], rtol=1e-5)


def test_eval_rows_count_only_the_trained_tokens():
    """`jzero eval`'s rows of a prompt/completion document keep the positions that predict its
    completion (the loss mask of the predicted token), cut to the context."""
    from jzero.runtime import evaluate
    tokens, mask = evaluate.rows([np.arange(6)], 4, [np.array([0, 0, 0, 1, 1, 1], np.uint8)])
    assert tokens.tolist() == [[0, 1, 2, 3, 0]] and mask.tolist() == [[False, False, True, False]]
    _, plain = evaluate.rows([np.arange(6)], 8)
    assert plain.tolist() == [[True] * 5 + [False] * 3]
