"""The KV-cached engine and its scheduler (`jzero.inference`), against the full forward.

Parity: greedy tokens from prefill -> insert -> generate equal `uncached.generate`'s for 64 tokens
on 3 prompts, and every logit the engine returns equals the full forward's at that position to
rtol 1e-5, on 1 device (learned positions, tied head) and with the slots split over 8 (rotary,
untied). Continuous batching: every request's tokens, greedy or sampled, equal the request run
alone through the full forward, whatever else shares the batch; decoding goes on between a long
prompt's chunks (static batching, the negative control, waits); bad input is one line.
"""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jzero import load_config
from jzero.analysis import profile
from jzero.config import ConfigError
from jzero.inference import engine, sampling, storage, uncached
from jzero.inference.scheduler import Request, Scheduler
from jzero.models import gpt

CFG = gpt.GPTConfig(seq_len=128, d_model=32, n_layers=2, n_heads=4, d_ff=64)
GREEDY = sampling.SamplingParams(temperature=0.0)
PROMPTS = [np.arange(5) + 1, np.arange(40) % 7 + 3, np.array([9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13])]
NEW = 64


def _params(cfg):
    return jax.jit(gpt.make(cfg)[0])(jax.random.key(0))


@pytest.fixture(scope="module", params=[
    pytest.param((1, "learned", True, "device"), id="1-device-learned"),
    pytest.param((8, "rotary", False, "host"), id="8-devices-rotary-untied-offloaded"),
    pytest.param((1, "rotary", True, "host"), id="1-device-rotary-offloaded", marks=pytest.mark.slow),
    pytest.param((8, "learned", False, "device"), id="8-devices-learned-untied", marks=pytest.mark.slow),
    pytest.param((8, "learned", True, "sharded"), id="8-devices-learned-sharded", marks=pytest.mark.slow)])
def engine_run(request):
    """The 3 prompts prefilled (chunk 32: the 40-token prompt takes two chunks) into slots 1, 3
    and 5 of 8, then 63 generate steps: (cfg, params, tokens [3, 64], logits [3, 64, vocab])."""
    devices, positions, tied, weights = request.param
    cfg = dataclasses.replace(CFG, positions=positions, tie_embeddings=tied)
    params = _params(cfg)
    eng = engine.Engine(gpt.decoder(cfg), params, slots=8, chunk=32, devices=devices, weights=weights)
    state, slots = eng.empty_state(), [1, 3, 5]
    tokens, logits = [], []
    for prompt, slot in zip(PROMPTS, slots, strict=True):
        prefix = eng.prefill_all(eng.start(GREEDY, 0), prompt)
        tokens.append([int(prefix.token)])
        logits.append([np.asarray(prefix.logits)])
        state = eng.insert(prefix, state, slot)
    for _ in range(NEW - 1):
        state, step = eng.generate(state)
        for row, slot in enumerate(slots):
            tokens[row].append(int(step.tokens[slot]))
            logits[row].append(np.asarray(step.logits[slot]))
    assert [(c.name, c.shape) for c in eng.compiles] == [("prefill", (16,)), ("insert", ()), ("prefill", (32,)),
                                                         ("generate", ())]  # once per shape, no recompiles
    assert state.cache.k.sharding.shard_shape(state.cache.k.shape)[1] == 8 // devices
    return cfg, params, np.array(tokens), np.array(logits)


def test_greedy_tokens_equal_the_uncached_forward(engine_run):
    cfg, params, tokens, _ = engine_run
    for prompt, got in zip(PROMPTS, tokens, strict=True):
        want = uncached.generate(cfg, params, jnp.asarray(prompt, jnp.int32), NEW, jax.random.key(0), GREEDY)
        np.testing.assert_array_equal(got, np.asarray(want))


def test_cached_logits_equal_the_full_forward(engine_run):
    """Each step's logits against one full forward over the prompt and the tokens generated."""
    cfg, params, tokens, logits = engine_run
    forward = jax.jit(lambda p, x: gpt.GPT(cfg).apply({"params": p}, x))
    for prompt, got_tokens, got in zip(PROMPTS, tokens, logits, strict=True):
        seq = np.zeros((1, cfg.seq_len), np.int32)
        seq[0, : len(prompt) + NEW - 1] = np.concatenate([prompt, got_tokens[:-1]])
        want = np.asarray(forward(params, seq))[0, len(prompt) - 1: len(prompt) + NEW - 1]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_zero_inference_keeps_weights_on_the_host_and_moves_a_layer_at_a_time():
    """With weights "host" the compiled decode step takes every weight from host memory (host bytes
    = the weights), its device arguments are the device engine's less the weights (cache and
    slot state only), and the CUDA lowering moves each layer's weights to the device inside the
    layer loop: never a whole stacked leaf."""
    cfg = dataclasses.replace(CFG, n_layers=4)
    params = _params(cfg)
    memory, temp = {}, {}
    for weights in ("device", "host"):
        eng = engine.Engine(gpt.decoder(cfg), params, slots=8, chunk=32, weights=weights)
        eng.generate(eng.empty_state())
        compiled = eng.executable("generate")
        on_host = sum(profile.shard_bytes(x.shape, x.dtype, s) for x, s in zip(
            jax.tree.leaves(eng.params), jax.tree.leaves(compiled.input_shardings[0][0]), strict=True)
            if s.memory_kind == "pinned_host")
        memory[weights] = (compiled.memory_analysis().argument_size_in_bytes, on_host)
        temp[weights] = compiled.memory_analysis().temp_size_in_bytes
    total = storage.weight_bytes(eng.params)
    layer = storage.weight_bytes(eng.params["blocks"]) // cfg.n_layers
    assert memory["host"][1] == total and memory["device"][1] == 0
    assert memory["host"][0] - total == memory["device"][0] - total  # CPU counts host arguments too
    assert temp["host"] - temp["device"] <= 2 * layer + (total - cfg.n_layers * layer)  # moved copies
    text = jax.jit(functools.partial(engine.generate_step, eng.decoder, eng.fetch)).trace(
        eng.params, eng.empty_state()).lower(lowering_platforms=("cuda",)).as_text()
    moved = {tuple(int(d) for d in shape.split("x"))
             for shape in re.findall(r'_xla_buffer_placement = "device"\}\} : \(tensor<([0-9x]+)x\w+>\)', text)}
    stacked = [x.shape for x in jax.tree.leaves(eng.params["blocks"])]
    assert {shape[1:] for shape in stacked} <= moved and not set(stacked) & moved


def test_sharded_weights_hold_an_eighth_a_device_and_gather_a_layer_at_a_time():
    """weights "sharded" over 8 devices: each holds about 1/8 of every weight, the compiled decode
    step all-gathers each stacked leaf once per layer inside the loop, and the tokens equal the
    replicated engine's."""
    cfg = dataclasses.replace(CFG, n_layers=3)
    params = _params(cfg)
    tokens = {}
    for weights in ("device", "sharded"):
        eng = engine.Engine(gpt.decoder(cfg), params, slots=8, chunk=32, devices=8, weights=weights)
        state = eng.insert(eng.prefill_all(eng.start(GREEDY, 0), PROMPTS[2]), eng.empty_state(), 4)
        tokens[weights] = [int(eng.generate(state)[1].tokens[4])]
    assert tokens["sharded"] == tokens["device"]
    total = storage.weight_bytes(eng.params)
    per_device = sum(profile.shard_bytes(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(eng.params))
    assert per_device <= total / 8 + 1024  # the LayerNorm scales that do not split stay whole
    gathers = [c for c in profile.comm(eng.executable("generate")).collectives if c.kind == "all-gather"]
    stacked = jax.tree.leaves(eng.params["blocks"])
    assert sum(c.count for c in gathers) >= cfg.n_layers * len(stacked)
    assert {c.count for c in gathers if c.count > 1} == {cfg.n_layers}


def test_int8_weights_compute_with_their_dequantized_values():
    """int8 weights (a scale per 32 elements): the engine's logits equal the full forward's on
    the dequantized weights (rtol 1e-5), weights take under 0.3x the fp32 bytes (int8 and a fp32
    scale per 32: 0.28x; LayerNorms and biases stay fp32), and the logits stay
    within 3% of the largest fp32 logit (random init; the trained model's held-out loss: docs)."""
    params = _params(CFG)
    prompt = PROMPTS[1]
    logits = {}
    for block in (0, 32):
        eng = engine.Engine(gpt.decoder(CFG), params, slots=1, chunk=64, int8_block=block)
        logits[block] = np.asarray(eng.prefill_all(eng.start(GREEDY, 0), prompt).logits)
        stored = eng.params
    assert 0.28 < storage.weight_bytes(stored) / storage.weight_bytes(params) < 0.30
    seq = np.zeros((1, CFG.seq_len), np.int32)
    seq[0, : len(prompt)] = prompt
    dense = storage.dequantized(stored, jnp.float32)
    want = np.asarray(jax.jit(lambda p, x: gpt.GPT(CFG).apply({"params": p}, x))(dense, seq))[0, len(prompt) - 1]
    np.testing.assert_allclose(logits[32], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.abs(logits[32] - logits[0]).max() < 0.03 * np.abs(logits[0]).max()
    assert not np.array_equal(logits[32], logits[0])


def _mixed_requests():
    """9 requests over 3 prompt lengths (one of 70 tokens: three chunks of 32), greedy and
    sampled, 1 to 24 tokens, one with a stop token."""
    rng = np.random.default_rng(0)
    lengths = [5, 70, 13] * 3
    settings = [GREEDY, sampling.SamplingParams(0.8), sampling.SamplingParams(1.0, top_k=5, top_p=0.9)]
    return [Request(rng.integers(0, CFG.vocab_size, n), int(rng.integers(1, 25)), settings[i % 3], seed=i, id=i)
            for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def small_engine():
    params = _params(CFG)
    return params, engine.Engine(gpt.decoder(CFG), params, slots=4, chunk=32, devices=2)


@pytest.mark.parametrize("static", [False, True], ids=["continuous", "static"])
def test_each_request_equals_its_uncached_generation(small_engine, static):
    """24 tokens of the full forward per request, cut to its max_tokens (token i is drawn with
    fold_in(key(seed), i) either way); the stop request ends on its stop token."""
    params, eng = small_engine
    requests = _mixed_requests()
    references = {r.id: np.asarray(uncached.generate(CFG, params, jnp.asarray(r.prompt, jnp.int32), 24,
                                                     jax.random.key(r.seed), r.settings)) for r in requests}
    requests[4].max_tokens, requests[4].stop = 24, int(references[4][6])
    done = Scheduler(eng, token_budget=40, static=static).run(requests)
    for progress in done:
        r = progress.request
        want = references[r.id][: r.max_tokens]
        if r.stop:  # a request's stop tokens (checked(): a tuple)
            want = want[: list(want).index(r.stop[0]) + 1]
        np.testing.assert_array_equal(progress.tokens, want, err_msg=f"request {r.id}")
        assert progress.reason == ("stop" if r.stop else "length")


def test_decoding_goes_on_between_a_long_prompts_chunks(small_engine):
    """A running request gets a token every iteration while a 70-token prompt is prefilled 32
    tokens an iteration; under static batching the long prompt waits for the slots to empty."""
    _, eng = small_engine
    running = Request(np.arange(5), 20, GREEDY, id=0)
    long = Request(np.arange(70) % 50, 3, GREEDY, id=1)
    continuous = Scheduler(eng, token_budget=36)
    continuous.submit(running)
    continuous.step()
    continuous.submit(long)
    iterations = [continuous.step() for _ in range(3)]
    assert [[e.id for e in events] for events in iterations] == [[0], [0], [0, 1]]  # chunks of 32, 32, 6
    static = Scheduler(eng, static=True)
    static.submit(running)
    events = static.step()
    static.submit(long)
    while static.busy:
        events += static.step()
    first_long = next(i for i, e in enumerate(events) if e.id == 1)
    assert events[first_long - 1].id == 0 and events[first_long - 1].finished == "length"


def test_context_end_finishes_a_request(small_engine):
    """A 120-token prompt in a 128-token context: 9 tokens fit (the last is not fed back)."""
    _, eng = small_engine
    scheduler = Scheduler(eng)
    progress = scheduler.submit(Request(np.arange(120) % 50, 50, GREEDY))
    while scheduler.busy:
        scheduler.step()
    assert len(progress.tokens) == 9 and progress.reason == "context"


@pytest.mark.parametrize("request_,message", [
    (Request(np.arange(0), 4), r"prompt: 1 to 128 tokens"),
    (Request(np.arange(129), 4), r"prompt: 1 to 128 tokens"),
    (Request(np.arange(3), 0), r"max_tokens: must be an integer >= 1"),
    (Request(np.arange(3), 4, sampling.SamplingParams(top_p=0.0)), r"top_p: must be in"),
])
def test_bad_requests_are_one_line(small_engine, request_, message):
    with pytest.raises(ValueError, match=message):
        Scheduler(small_engine[1]).submit(request_)


def test_engine_settings_and_weights_are_checked():
    params = _params(CFG)
    with pytest.raises(ValueError, match=r"engine devices: 3 must divide slots \(8\)"):
        engine.Engine(gpt.decoder(CFG), params, slots=8, devices=3)
    with pytest.raises(ValueError, match=r"engine chunk: must be an integer >= 1"):
        engine.Engine(gpt.decoder(CFG), params, chunk=0)
    config = load_config({"train_batch_size": 8, "jzero": {"model": {"size": "tiny", "d_model": 32}}})
    with pytest.raises(ConfigError, match=r"ckpt: does not fit the config's model: .* has shape"):
        engine.for_config(config, params, "ckpt")
    moe = load_config({"train_batch_size": 8, "moe": {"enabled": True, "num_experts": 2},
                       "jzero": {"model": {"size": "tiny"}}})
    with pytest.raises(ConfigError, match=r"generation: the KV-cached decoder serves dense GPTs"):
        engine.for_config(moe, params)


def test_jzero_generate_streams_the_engines_tokens(tmp_path, capsys):
    """`jzero generate` on exported safetensors weights prints the prompt and the greedy tokens
    of the full forward; a bad flag is one line and exit code 2."""
    from safetensors.numpy import save_file

    from jzero.cli import main
    from jzero.zero import treepath

    config = tmp_path / "tiny.json"
    config.write_text('{"train_batch_size": 8, "jzero": {"model": {"size": "tiny"}}}')
    cfg = gpt.GPTConfig()
    params = _params(cfg)
    weights = tmp_path / "w.safetensors"
    save_file({k.replace("/", "."): np.asarray(v) for k, v in treepath.named_leaves(params).items()}, str(weights))
    args = ["generate", str(config), "--checkpoint", str(weights), "--prompt", "def ", "--temperature", "0"]
    assert main([*args, "--max-tokens", "12"]) == 0
    want = uncached.generate(cfg, params, jnp.asarray(list(b"def "), jnp.int32), 12, jax.random.key(0), GREEDY)
    assert capsys.readouterr().out == (b"def " + bytes(np.asarray(want, np.uint8))).decode("utf-8", "replace") + "\n"
    assert main([*args, "--max-tokens", "0"]) == 2
    assert capsys.readouterr().err == "jzero: error: --max-tokens: must be an integer >= 1, got 0\n"
    # where the engine runs is not how training split its batch (8 rows do not split over 3)
    assert main([*args, "--max-tokens", "12", "--devices", "3"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    for flag, value, message in (("--stop", "999", "--stop: 999 is outside the vocabulary 0..255"),
                                 ("--int8-block", "7", "--int8-block: 7 quantizes no weight")):
        assert main([*args, "--max-tokens", "4", flag, value]) == 2
        assert capsys.readouterr().err.startswith(f"jzero: error: {message}")
    assert main(["serve", str(config), "--checkpoint", str(weights), "--port", "99999"]) == 2
    assert capsys.readouterr().err == "jzero: error: --port: must be 0..65535 (0: any free port), got 99999\n"
