"""Hugging Face checkpoints in (issue 50), against transformers itself: random-weight Llama (GQA,
llama3 RoPE), Mistral (MQA, a sliding window shorter than the sequence), Qwen2 (biases, tied,
per-layer windows), Qwen3 (q/k norm, head_dim != hidden / heads, YaRN) and GPT-2 checkpoints,
every parameter re-randomised and saved sharded (`hf_models`). jzero's logits equal
transformers' at one device; its evaluation loss equals transformers' loss at 8 devices under
ZeRO-3 with tensor parallelism 2, the params read shard by shard into their final layout. Bad
directories are one line naming the tensor, key or file."""
import dataclasses
import json
import re
import tracemalloc

import hf_models
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jzero
from jzero import models
from jzero.config import ConfigError
from jzero.models import gpt, hfconfig, llama
from jzero.runtime import hf

from helpers import ROOT, jzero_cli

FINETUNE = ROOT / "configs" / "hf_finetune.json"
MODULES = {"llama": llama.Llama, "gpt": gpt.GPT}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    return {kind: hf_models.make(kind, base / kind) for kind in hf_models.FAMILIES}


def logits_of(directory, tokens):
    spec = hfconfig.from_dict(hfconfig.read(directory))
    model = models.FROM_SPEC[spec.name](spec.model)
    lazy = hf.lazy_params(directory, spec.name, jax.eval_shape(model.init_fn, jax.random.key(0)))
    params = jax.tree.map(lambda leaf: leaf[...], lazy, is_leaf=lambda x: isinstance(x, hf.Lazy))
    module = MODULES[spec.name](dataclasses.replace(spec.model, loss_tile=0))
    return np.asarray(jax.jit(module.apply)({"params": params}, jnp.asarray(tokens)))


def assert_logits_close(mine, ref):
    np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("kind", hf_models.FAMILIES)
def test_logits_equal_transformers(saved, kind):
    ref = saved[kind]
    assert len(list(ref["dir"].glob("model-*.safetensors"))) > 1  # sharded, with its index
    assert_logits_close(logits_of(ref["dir"], ref["tokens"][:, :-1]), ref["logits"])


def test_a_bf16_checkpoint_loads(tmp_path):
    ref = hf_models.make("qwen3", tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((ref["dir"] / "config.json").read_text()).get("dtype") == "bfloat16"
    assert_logits_close(logits_of(ref["dir"], ref["tokens"][:, :-1]), ref["logits"])  # the bf16 weights, in fp32


def hf_config(directory, **extra):
    """8 devices, ZeRO-3 and tensor groups of 2; rows of the reference batch's 40 tokens (the
    checkpoint's context is 64: ``jzero.model.seq_len`` may say less)."""
    return jzero.load_config({
        "train_batch_size": hf_models.ROWS, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "tensor_parallel": {"autotp_size": 2},
        "jzero": {"mesh": {"devices": 8}, "model": {"hf": str(directory), "seq_len": hf_models.LENGTH}}, **extra})


def hf_state(directory, cfg):
    model = models.build(cfg)
    family = hfconfig.spec(cfg).name
    lazy = hf.lazy_params(directory, family, jax.eval_shape(model.init_fn, jax.random.key(0)))
    return model, jzero.init(model.init_fn, cfg, loss_fn=model.loss_fn, rng=0, params=lazy, stages=model.stages)


@pytest.mark.parametrize("kind", [k if k in ("llama", "gpt2") else pytest.param(k, marks=pytest.mark.slow)
                                  for k in hf_models.FAMILIES])
def test_zero3_tensor_parallel_loss_equals_transformers(saved, kind):
    """ZeRO-3 over 4 data devices x tensor groups of 2 (AutoTP's rules find the HF names): each
    param lands in the plan's layout; the logits from the sharded params are transformers', and
    the held-out loss through the step (ZeRO-3's per-layer gathers, tensor parallelism) is
    transformers' loss."""
    ref = saved[kind]
    model, state = hf_state(ref["dir"], hf_config(ref["dir"]))
    assert dict(state.plan.mesh.shape)["tensor"] == 2
    for leaf, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.plan.params), strict=True):
        assert leaf.sharding == want
    assert any("tensor" in str(s.spec) for s in jax.tree.leaves(state.plan.params))
    assert_logits_close(np.asarray(jax.jit(model.forward)(state.params, ref["tokens"][:, :-1])), ref["logits"])
    loss = jzero.eval_step(state, {"inputs": ref["tokens"][:, :-1], "targets": ref["tokens"][:, 1:]})
    assert float(loss) == pytest.approx(ref["loss"], rel=1e-4)


def edited(saved, tmp_path, kind, change):
    """A copy of ``kind``'s directory with ``change(directory)`` applied."""
    import shutil

    directory = tmp_path / kind
    shutil.copytree(saved[kind]["dir"], directory)
    change(directory)
    return directory


def set_config(**values):
    def change(directory):
        path = directory / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
    return change


def drop_shard(directory):
    index = json.loads((directory / hf.INDEX).read_text())
    (directory / index["weight_map"]["model.layers.1.mlp.up_proj.weight"]).unlink()


@pytest.mark.parametrize("kind,change,match", [
    ("llama", set_config(model_type="falcon"), r"model_type: 'falcon' is not supported; supported: llama"),
    ("llama", set_config(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
     r"rope_type: 'longrope' is not supported; supported: default, linear, llama3, yarn"),
    ("llama", set_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     r"rope_type: 'dynamic' is not supported"),
    ("llama", set_config(hidden_act="gelu"), r"hidden_act: 'gelu' is not supported"),
    ("llama", drop_shard, r"shard model-\d+-of-\d+\.safetensors \(holding model\.layers\.\d\.\S+\) is missing from"),
    ("llama", set_config(intermediate_size=96),
     r"tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape \[\d+, \d+\], config\.json gives \[\d+, \d+\]"),
    ("gpt2", set_config(n_layer=2), r"tensor transformer\.h\.2\.\S+ has no place in the model"),
    ("qwen2", set_config(layer_types=["full_attention", "chunked_attention", "full_attention"]),
     r"layer_types: 'chunked_attention' is not supported"),
])
def test_a_bad_directory_is_one_line_naming_what(saved, tmp_path, kind, change, match):
    directory = edited(saved, tmp_path, kind, change)
    with pytest.raises(ConfigError, match=match) as err:
        spec = hfconfig.from_dict(hfconfig.read(directory))
        model = models.FROM_SPEC[spec.name](spec.model)
        hf.lazy_params(directory, spec.name, jax.eval_shape(model.init_fn, jax.random.key(0)))
    assert "\n" not in str(err.value)


def test_loading_streams_one_shard_at_a_time(tmp_path):
    """Host memory a ZeRO-3 load allocates beyond the params it leaves (tracemalloc: numpy's
    buffers; XLA's device buffers are not counted) stays under 2 x the largest tensor + 1 MiB,
    on a checkpoint whose embedding (4 MiB) is a third of the model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                 num_attention_heads=4, max_position_embeddings=64)).save_pretrained(
        tmp_path, max_shard_size="1MB")
    largest = 4096 * 256 * 4
    cfg = jzero.load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3},
                             "jzero": {"mesh": {"devices": 8}, "model": {"hf": str(tmp_path)}}})
    model = models.build(cfg)
    shapes = jax.eval_shape(model.init_fn, jax.random.key(0))
    total = sum(x.size * 4 for x in jax.tree.leaves(shapes))
    tracemalloc.start()
    state = jzero.init(model.init_fn, cfg, loss_fn=model.loss_fn, rng=0, stages=model.stages,
                       params=hf.lazy_params(tmp_path, "llama", shapes))
    jax.block_until_ready(state.params)
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert total > 3 * largest
    print(f"load: peak {peak - kept} B beyond the {kept} B kept; largest tensor {largest} B, model {total} B")
    assert peak - kept < 2 * largest + 2**20, (peak, kept, largest, total)


def transformers_loss(ref, texts):
    """transformers' mean next-token loss over ``texts``, each tokenized on its own (tokenizers'
    own ids) and cut to the context: the mean over every predicted position of every document."""
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ref["dir"] / "tokenizer.json"))
    total, count = 0.0, 0
    for doc in texts:
        ids = torch.tensor([tok.encode(doc).ids[:hf_models.CONTEXT]])
        with torch.no_grad():
            logp = torch.log_softmax(ref["model"](ids).logits[0, :-1].float(), -1)
        total -= float(logp.gather(1, ids[0, 1:, None]).sum())
        count += ids.shape[1] - 1
    return total / count, count


@pytest.mark.parametrize("kind", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_jzero_eval_equals_transformers_loss(saved, tmp_path, kind):
    ref = saved[kind]
    data = tmp_path / "docs.jsonl"
    texts = hf_models.TEXTS + ["x" * 200]  # the last one longer than the context: cut to it
    data.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    run = jzero_cli("eval", str(FINETUNE), "--hf", str(ref["dir"]), "--data", str(data), "--devices", "2", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    loss, count = transformers_loss(ref, texts)
    assert got["documents"] == len(texts) and got["tokens"] == count
    assert got["loss"] == pytest.approx(loss, rel=1e-4) and got["perplexity"] == pytest.approx(np.exp(loss), rel=1e-4)


@pytest.mark.parametrize("kind", ["llama", pytest.param("qwen2", marks=pytest.mark.slow),
                                  pytest.param("mistral", marks=pytest.mark.slow),
                                  pytest.param("qwen3", marks=pytest.mark.slow),
                                  pytest.param("gpt2", marks=pytest.mark.slow)])
def test_greedy_generate_equals_transformers(saved, kind):
    """32 greedy tokens through the KV cache (past the sliding windows: 8 positions) equal
    transformers' greedy generate on the same prompt ids, stopping at the same EOS."""
    import torch
    from tokenizers import Tokenizer

    ref, prompt = saved[kind], "def add(a, b):"
    run = jzero_cli("generate", str(FINETUNE), "--hf", str(ref["dir"]), "--prompt", prompt, "--temperature", "0",
                    "--max-tokens", "32", "--devices", "1", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    ids = Tokenizer.from_file(str(ref["dir"] / "tokenizer.json")).encode(prompt).ids
    assert got["prompt_ids"] == ids
    with torch.no_grad():
        out = ref["model"].generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32,
                                    eos_token_id=hf_models.EOS, pad_token_id=hf_models.EOS)
    assert got["token_ids"] == out[0, len(ids):].tolist()
    assert isinstance(got["text"], str)


@pytest.mark.slow
def test_serve_chat_models_api_key_and_n(saved, tmp_path):
    """`jzero serve --hf DIR --api-key K` on a loopback port, called with a real HTTP client:
    /v1/ calls without the key get 401; /v1/models lists the model; a chat completion renders the
    messages with the checkpoint's template as transformers does and answers transformers' greedy
    tokens (stopping at EOS), whole and streamed (deltas that join to the same text); n = 2 is a
    422 naming n."""
    import asyncio
    import os
    import subprocess
    import sys

    import aiohttp
    import torch
    from test_serve import _free_port
    from transformers import AutoTokenizer

    ref, port, key = saved["llama"], _free_port(), "sk-test"
    proc = subprocess.Popen([sys.executable, "-m", "jzero.cli", "serve", str(FINETUNE), "--hf", str(ref["dir"]),
                             "--devices", "1", "--port", str(port), "--slots", "2", "--api-key", key],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    ids = AutoTokenizer.from_pretrained(ref["dir"]).apply_chat_template(messages, add_generation_prompt=True,
                                                                        tokenize=True, return_dict=False)
    room = hf_models.CONTEXT - len(ids) + 1  # the last token is read off a full context, never cached
    assert 8 < room < 24
    with torch.no_grad():
        want = ref["model"].generate(torch.tensor([ids]), do_sample=False, max_new_tokens=room,
                                     eos_token_id=hf_models.EOS, pad_token_id=hf_models.EOS)[0, len(ids):].tolist()
    body = {"messages": messages, "max_tokens": 24, "temperature": 0}  # the context ends it first

    async def calls():
        async with aiohttp.ClientSession() as session:
            for _ in range(600):
                try:
                    async with session.get(f"{url}/health"):
                        break
                except aiohttp.ClientConnectionError:
                    assert proc.poll() is None, proc.stdout.read()
                    await asyncio.sleep(0.2)
            async with session.get(f"{url}/v1/models") as r:
                assert r.status == 401
            async with session.get(f"{url}/v1/models", headers=auth) as r:
                assert r.status == 200 and (await r.json())["data"][0]["id"] == ref["dir"].name
            async with session.post(f"{url}/v1/chat/completions", json=body, headers=auth) as r:
                whole = await r.json()
            async with session.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=auth) as r:
                chunks = [json.loads(line[6:]) async for line in r.content
                          if line.startswith(b"data: {")]
            async with session.post(f"{url}/v1/chat/completions", json={**body, "n": 2}, headers=auth) as r:
                refused = r.status, await r.json()
            return whole, chunks, refused

    try:
        whole, chunks, refused = asyncio.run(calls())
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    choice = whole["choices"][0]
    assert whole["object"] == "chat.completion" and choice["token_ids"] == want
    assert choice["finish_reason"] == ("stop" if hf_models.EOS in want else "length")
    assert choice["message"]["role"] == "assistant"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == choice["message"]["content"]
    assert refused[0] == 422 and refused[1]["error"]["message"].startswith("n:")


@pytest.mark.parametrize("kind", ["qwen2", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_export_round_trip_loads_in_transformers(saved, tmp_path, kind):
    """Fine-tune 3 steps at ZeRO-3 on 4 devices (the warmup's lr is 0 for the first two), export
    with --hf in shards: transformers loads
    the directory with no missing or unexpected key and computes the checkpoint's logits; the
    tokenizer came along; a second export into the same place is refused."""
    import torch
    from transformers import AutoModelForCausalLM

    from jzero.runtime.weights import read_params

    ref, out = saved[kind], tmp_path / "run"
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": t * 20}) for t in hf_models.TEXTS) + "\n")
    run = jzero_cli("train", str(FINETUNE), "--hf", str(ref["dir"]), "--data", str(data), "--steps", "3",
                    "--out", str(out), "--set", "jzero.checkpoint.interval=3", "--set", "jzero.train.eval_interval=3")
    assert run.returncode == 0, run.stderr[-2000:]
    export = tmp_path / "export"
    run = jzero_cli("export", str(out / "checkpoints"), "--hf", str(export), "--max-shard-size", "30KB")
    assert run.returncode == 0, run.stderr[-2000:]
    assert (export / hf.INDEX).is_file() and (export / "tokenizer.json").is_file()
    model, info = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    tokens = ref["tokens"][:, :-1]
    with torch.no_grad():
        theirs = model.eval()(torch.tensor(tokens)).logits.numpy()
    spec = hfconfig.from_dict(hfconfig.read(ref["dir"]))
    params = read_params(out / "checkpoints")
    mine = MODULES[spec.name](dataclasses.replace(spec.model, loss_tile=0)).apply({"params": params}, tokens)
    assert_logits_close(np.asarray(mine), theirs)
    assert not np.allclose(theirs, ref["logits"], atol=1e-3)  # trained: not the starting weights
    again = jzero_cli("export", str(out / "checkpoints"), "--hf", str(export))
    assert again.returncode == 2 and "exists and is not empty" in again.stderr


def transformers4(directory):
    """config.json in transformers 4.x's spelling: rope_theta and rope_scaling, torch_dtype."""
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    rope = dict(raw.pop("rope_parameters"))
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = {"type" if rope.get("rope_type") == "linear" else "rope_type": rope.pop("rope_type"),
                           **rope} if rope.get("rope_type", "default") != "default" else None
    raw["torch_dtype"] = raw.pop("dtype")
    path.write_text(json.dumps(raw))


def test_transformers_4_spelling_reads_the_same(saved, tmp_path):
    ref = saved["llama"]  # llama3 scaling: the rope settings must come through the old keys
    directory = edited(saved, tmp_path, "llama", transformers4)
    raw = json.loads((directory / "config.json").read_text())
    assert "rope_parameters" not in raw and raw["rope_scaling"]["rope_type"] == "llama3" and "torch_dtype" in raw
    assert hfconfig.from_dict(raw).model == hfconfig.from_dict(hfconfig.read(ref["dir"])).model
    assert_logits_close(logits_of(directory, ref["tokens"][:, :-1]), ref["logits"])


def drop_tokenizer(directory):
    (directory / "tokenizer.json").unlink()


@pytest.mark.parametrize("change,match", [
    (drop_tokenizer, r"jzero: error: jzero\.model\.hf: \S+tokenizer\.json not found"),
    pytest.param(set_config(model_type="falcon"), r"jzero: error: config\.json model_type: 'falcon' is not supported",
                 marks=pytest.mark.slow),
    pytest.param(None, r"jzero: error: --data: \S+bad\.jsonl line 2: not JSON", marks=pytest.mark.slow),
])
def test_cli_refuses_a_bad_directory_or_data_in_one_line_exit_2(saved, tmp_path, change, match):
    directory = edited(saved, tmp_path, "llama", change or (lambda d: None))
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine"}\n{"text": oops}\n')
    run = jzero_cli("eval", str(FINETUNE), "--hf", str(directory), "--data", str(data), "--devices", "1")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert re.search(match, run.stderr.strip().splitlines()[-1]), run.stderr[-500:]


@pytest.mark.parametrize("kind,extra", [
    ("llama", {"sequence_parallel_size": 2}),  # Ulysses over grouped-query heads (6 q, 2 kv)
    ("mistral", {"attention": {"implementation": "blockwise", "block_q": 8, "block_k": 8}}),  # window as a mask
])
def test_loss_equals_transformers_under_other_layouts(saved, kind, extra):
    ref, extra = saved[kind], dict(extra)
    section = {"hf": str(ref["dir"]), "seq_len": hf_models.LENGTH}
    if "attention" in extra:
        section["attention"] = extra.pop("attention")
    cfg = jzero.load_config({"train_batch_size": hf_models.ROWS, "zero_optimization": {"stage": 1},
                             "jzero": {"mesh": {"devices": 4}, "model": section}, **extra})
    _, state = hf_state(ref["dir"], cfg)
    loss = jzero.eval_step(state, {"inputs": ref["tokens"][:, :-1], "targets": ref["tokens"][:, 1:]})
    assert float(loss) == pytest.approx(ref["loss"], rel=1e-4)


def test_linear_rope_scaling_equals_transformers(saved, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    directory = edited(saved, tmp_path, "llama", set_config(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}))
    tokens = saved["llama"]["tokens"][:, :-1]
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()(
            torch.tensor(tokens)).logits.numpy()
    assert_logits_close(logits_of(directory, tokens), theirs)


def test_a_shape_key_beside_hf_is_refused_naming_it(saved):
    """The directory decides the model's shape: a config that also says n_layers would be
    silently ignored, so it is refused; seq_len (shorter than the context) and loss_tile pass."""
    directory = str(saved["llama"]["dir"])
    with pytest.raises(ConfigError, match=r"^jzero\.model\.n_layers: the Hugging Face directory .* sets the model"):
        hfconfig.spec(jzero.load_config({"train_batch_size": 8, "jzero": {"mesh": {"devices": 1}, "model": {
            "hf": directory, "n_layers": 4}}}))
    spec = hfconfig.spec(jzero.load_config({"train_batch_size": 8, "jzero": {"mesh": {"devices": 1}, "model": {
        "hf": directory, "seq_len": 32, "loss_tile": 0}}}))
    assert (spec.model.seq_len, spec.model.loss_tile, spec.model.n_layers) == (32, 0, hf_models.LAYERS)
    with pytest.raises(ConfigError, match=r"^jzero\.model\.seq_len: 65 is longer than the model's context 64"):
        hfconfig.spec(jzero.load_config({"train_batch_size": 8, "jzero": {"mesh": {"devices": 1}, "model": {
            "hf": directory, "seq_len": 65}}}))


def test_a_pipeline_over_layers_with_different_windows_is_refused(saved):
    """Qwen2's windows on layers 1-2 only: one program for every stage cannot tell a chunk's
    layers apart, so the pipeline is refused naming the key and the reason."""
    cfg = jzero.load_config({"train_batch_size": 8, "gradient_accumulation_steps": 2, "pipeline": {"stages": 3},
                             "jzero": {"mesh": {"devices": 3}, "model": {"hf": str(saved["qwen2"]["dir"])}}})
    with pytest.raises(ConfigError, match=r"^pipeline\.stages: 3 needs every layer to attend alike; .*\[0, 8\]"):
        models.build(cfg)
