"""``jzero eval CONFIG (--hf DIR | --checkpoint P) --data FILE``: a language model's mean
next-token cross entropy and perplexity over a dataset's documents (`jzero.runtime.evaluate`)."""
from __future__ import annotations

import argparse
import json

from jzero.cli.common import UsageError, add_config_arguments, config_on_devices


def add_parser(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser("eval", help="mean next-token loss and perplexity of a model's weights over documents")
    add_config_arguments(ev)
    ev.add_argument("--checkpoint", help="a jzero checkpoint or exported .safetensors (default: --hf's weights)")
    ev.add_argument("--data", required=True,
                    help='JSON lines of {"text": ...} (a document a line), a text file (one document) or a folder; '
                    'fine-tuning records (.jsonl / .parquet of messages or prompt/completion) count only the '
                    'tokens their loss trains')
    ev.add_argument("--batch", type=int, default=8, help="documents a call, rounded up to the devices (default 8)")
    ev.add_argument("--json", action="store_true", help="print one JSON object: loss, perplexity, tokens, documents")
    ev.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raw = config_on_devices(args)
    if args.checkpoint is None and args.hf is None and raw.get("jzero", {}).get("model", {}).get("hf") is None:
        raise UsageError("jzero eval: give the weights: --hf DIR or --checkpoint PATH")
    if args.batch < 1:
        raise UsageError(f"--batch: must be >= 1, got {args.batch}")
    import jax

    from jzero import models
    from jzero.config import ConfigError
    from jzero.inference import text
    from jzero.models import lora
    from jzero.runtime import engine, evaluate
    from jzero.runtime.weights import read_params, with_saved_lora
    from jzero.tasks import records
    from jzero.tasks.text import documents
    from jzero.train.resolve import load_config
    from jzero.train.state import init

    config = with_saved_lora(load_config(raw), args.checkpoint)
    model = models.build(config)
    if model.forward is None or not hasattr(model.spec, "vocab_size"):
        raise UsageError(f"jzero eval: scores language models (gpt, llama, a Hugging Face directory), not "
                         f"{model.name!r}")
    tokenizer = text.for_model(model.spec.vocab_size, config.jzero.model.hf)
    try:
        params = read_params(args.checkpoint) if args.checkpoint else engine.pretrained(config, model)
    except FileNotFoundError as e:
        raise UsageError(f"--checkpoint: {e}") from None
    state = init(model.init_fn, config, loss_fn=model.loss_fn, rng=0, params=params, stages=model.stages)
    masks = None
    try:
        if records.is_records(args.data) and records.first_format(args.data, config.jzero.data) != "text":
            # chats and prompt/completion pairs: their loss masks say what counts
            found = list(records.documents(args.data, config.jzero.data, tokenizer))
            docs, masks = [d.tokens for d in found], [d.mask for d in found]
        else:
            docs = [tokenizer.encode(doc) for doc in documents(args.data, key="--data")]
    except ConfigError:
        raise
    except ValueError as e:  # a model without a tokenizer
        raise UsageError(f"--data: {e}") from None
    tokens, mask = evaluate.rows(docs, model.spec.seq_len, masks)
    devices = jax.device_count()
    batch = -(-args.batch // devices) * devices
    params = lora.for_inference(state.params, config.jzero.lora)
    result = evaluate.evaluate(model.forward, params, tokens, mask, state.plan.mesh, batch)
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(f"jzero: eval {args.data}: loss {result.loss:.4f}, perplexity {result.perplexity:.4g} over "
              f"{result.tokens:,} predicted tokens of {result.documents:,} documents")
    return 0
