"""``jzero generate CONFIG --checkpoint DIR --prompt TEXT``: stream a trained GPT's continuation.

The weights come from a jzero checkpoint (any stage, any mesh) or an exported safetensors file;
the tokens from `jzero.inference`'s KV-cached engine, printed as they are sampled. A byte-level
model (vocab 256, the bundled corpus's) reads and prints UTF-8 text; another takes ``--prompt-ids``
and prints ids.
"""
from __future__ import annotations

import argparse
import json
import sys

from jzero.cli.common import UsageError, add_config_arguments, config_on_devices


def add_weights_arguments(parser: argparse.ArgumentParser) -> None:
    """The weights flags of every command that serves a model."""
    parser.add_argument("--checkpoint", help="a jzero checkpoint directory (its newest step), a step directory, or "
                        "a .safetensors file (default: --hf's weights)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype (default fp32)")
    parser.add_argument("--weights", choices=["device", "sharded", "host"], default="device",
                        help="device: whole on each device; sharded: split over --devices, gathered a layer at a "
                             "time; host: ZeRO-Inference, in host memory, a layer at a time on the device")
    parser.add_argument("--int8-block", type=int, default=0, metavar="N",
                        help="int8 weights with a scale per N elements (default 0: unquantized)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="stream a trained GPT's continuation of a prompt")
    add_config_arguments(gen)
    add_weights_arguments(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text (through --hf's tokenizer; UTF-8 bytes for byte-level models)")
    prompt.add_argument("--prompt-ids", type=int, nargs="+", metavar="ID", help="token ids")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1.0)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (default 0: all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus: the smallest set with this mass (default 1)")
    gen.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    gen.add_argument("--stop", type=int, help="a token id that ends generation (default: the tokenizer's EOS)")
    gen.add_argument("--json", action="store_true", help="print one JSON object: prompt_ids, token_ids, text")
    gen.add_argument("--chat", action="store_true", help="send --prompt as one user message through the "
                     "tokenizer's chat template (as /v1/chat/completions does) and print only the reply")
    gen.set_defaults(func=run)


def engine_from(args: argparse.Namespace, slots: int | None = None) -> tuple:
    """(config, engine) of the command's config and checkpoint: ``slots`` slots (default: one a
    device) over ``--devices`` devices (default 1)."""
    raw = config_on_devices(args)
    import jax.numpy as jnp

    from jzero.inference import engine, storage
    from jzero.models import lora
    from jzero.runtime.weights import read_params, with_saved_lora
    from jzero.train.resolve import load_config

    config = with_saved_lora(load_config(raw, dp_size=_trained_dp(raw)), args.checkpoint)
    if args.checkpoint is None and config.jzero.model.hf is None:
        raise UsageError("--checkpoint: give the weights (or --hf DIR, a Hugging Face model directory)")
    try:
        params = read_params(args.checkpoint) if args.checkpoint else hf_params(config)
    except FileNotFoundError as e:
        raise UsageError(f"--checkpoint: {e}") from None
    params = lora.for_inference(params, config.jzero.lora)
    dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[args.dtype]
    if args.int8_block < 0:
        raise UsageError(f"--int8-block: must be >= 0 (0: unquantized), got {args.int8_block}")
    if args.int8_block and not storage.quantizable(params, args.int8_block):
        raise UsageError(f"--int8-block: {args.int8_block} quantizes no weight (none has a last dimension that "
                         "splits into blocks of it); try a divisor of the model's width, e.g. 32")
    devices = args.devices or 1
    try:
        source = f"--checkpoint {args.checkpoint}" if args.checkpoint else f"--hf {config.jzero.model.hf}"
        return config, engine.for_config(config, params, source, slots=slots or devices,
                                         dtype=dtype, devices=devices, weights=args.weights,
                                         int8_block=args.int8_block)
    except ValueError as e:  # the engine's settings: --slots, --devices
        raise UsageError(str(e)) from None


def hf_params(config) -> dict:
    """The weights of ``config``'s Hugging Face directory as host arrays (the engine places them)."""
    import jax

    from jzero import models
    from jzero.runtime import engine, hf

    lazy = engine.pretrained(config, models.build(config))
    return jax.tree.map(lambda leaf: leaf[...], lazy, is_leaf=lambda x: isinstance(x, hf.Lazy))


def _trained_dp(raw: dict) -> int:
    """A data-parallel size the config's batch keys hold for: the config is read for its model and
    precision, and ``--devices`` says where the engine runs, not how training split its batch."""
    train, micro = raw.get("train_batch_size"), raw.get("train_micro_batch_size_per_gpu")
    accum = raw.get("gradient_accumulation_steps") or 1
    if isinstance(train, int) and isinstance(micro, int) and isinstance(accum, int) and micro * accum > 0:
        return max(1, train // (micro * accum))
    return 1


def prompt_tokens(tokenizer, text: str | None, ids: list[int] | None, chat: bool = False) -> list[int]:
    """The prompt as token ids: ``text`` through the model's tokenizer (``chat``: as a user
    message rendered with its chat template), else ``ids``."""
    if chat and text is None:
        raise UsageError("--chat: needs --prompt (text for the user message)")
    if text is not None:
        try:
            if chat:
                return tokenizer.encode(tokenizer.chat([{"role": "user", "content": text}]), special=False)
            return tokenizer.encode(text)
        except ValueError as e:
            raise UsageError(f"--prompt: {e}" + ("" if chat else " (--prompt-ids)")) from None
    bad = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
    if bad:
        raise UsageError(f"--prompt-ids: {bad[0]} is outside the vocabulary 0..{tokenizer.vocab_size - 1}")
    return ids


def run(args: argparse.Namespace) -> int:
    from jzero.inference import sampling
    from jzero.inference.scheduler import Request, stream
    from jzero.inference.text import for_model

    config, eng = engine_from(args)
    tokenizer = for_model(eng.decoder.vocab_size, config.jzero.model.hf)
    tokens = prompt_tokens(tokenizer, args.prompt, args.prompt_ids, args.chat)
    vocab = eng.decoder.vocab_size
    stops = [args.stop] if args.stop is not None else tokenizer.eos
    if args.stop is not None and not 0 <= args.stop < vocab:
        raise UsageError(f"--stop: {args.stop} is outside the vocabulary 0..{vocab - 1}")
    try:
        request = Request(tokens, args.max_tokens, sampling.SamplingParams(args.temperature, args.top_k, args.top_p),
                          seed=args.seed, stop=tuple(stops)).checked(eng.decoder.max_len)
    except ValueError as e:
        raise UsageError(f"--{str(e).replace('_', '-')}") from None
    room = eng.decoder.max_len - len(tokens) + 1
    if args.max_tokens > room:
        print(f"jzero: warning: --max-tokens {args.max_tokens}: the model's context ({eng.decoder.max_len}) "
              f"leaves room for {room} after the {len(tokens)}-token prompt", file=sys.stderr)
    words = tokenizer.detokenizer()
    if args.json:
        generated = list(stream(eng, request))
        print(json.dumps({"prompt_ids": tokens, "token_ids": generated, "text": words.of(generated)}))
        return 0
    if args.prompt is not None and not args.chat:
        sys.stdout.write(args.prompt)
    for token in stream(eng, request):
        sys.stdout.write(words.piece(token))
        sys.stdout.flush()
    sys.stdout.write(words.flush() + "\n")
    return 0
