"""``jzero serve CONFIG --checkpoint DIR``: serve a trained GPT over HTTP (`jzero.runtime.server`).

Bound to 127.0.0.1 unless ``--host`` says otherwise; SIGTERM or Ctrl-C finishes the requests in
flight (up to ``--drain`` seconds) and exits 0.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from jzero.cli.common import UsageError, add_config_arguments
from jzero.cli.generate import add_weights_arguments, engine_from


def add_parser(sub: argparse._SubParsersAction) -> None:
    srv = sub.add_parser("serve", help="serve a model: OpenAI-style /v1/completions, /v1/chat/completions, "
                         "/v1/models, GET /health")
    add_config_arguments(srv)
    add_weights_arguments(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--slots", type=int, default=8, help="requests decoded together (default 8)")
    srv.add_argument("--max-tokens-limit", type=int, default=256, help="most tokens one request may ask (default 256)")
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    srv.add_argument("--drain", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ calls (env JZERO_API_KEY)")
    srv.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for flag in ("slots", "max_tokens_limit", "max_body_bytes"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port: must be 0..65535 (0: any free port), got {args.port}")
    try:
        from jzero.runtime import server
    except ModuleNotFoundError as e:
        raise UsageError(f"jzero serve needs aiohttp: pip install 'jzero[serve]' ({e})") from None
    from jzero.inference import text

    config, engine = engine_from(args, slots=args.slots)
    hf = config.jzero.model.hf
    name = Path(hf).name if hf else config.jzero.model.size or "gpt"
    key = args.api_key or os.environ.get("JZERO_API_KEY")
    server.serve(engine, name, args.host, args.port, server.Limits(args.max_tokens_limit, args.max_body_bytes),
                 args.drain, text.for_model(engine.decoder.vocab_size, hf), key)
    print("jzero: serve stopped cleanly", flush=True)
    return 0
