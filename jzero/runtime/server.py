"""`jzero serve`: an OpenAI-style completions server over the continuous-batching scheduler.

``POST /v1/completions`` takes ``prompt`` (text, through the model's tokenizer, or a list of
token ids), ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed`` and ``stream``; it
answers one JSON completion, or with ``stream`` server-sent events (a chunk per token, then
``[DONE]``). ``POST /v1/chat/completions`` takes ``messages`` instead, rendered with the
tokenizer's chat template (`jzero.inference.text.HF.chat`, ``add_generation_prompt``), and
answers OpenAI's chat shapes (``message``; streamed, ``delta``s). Both stop at the tokenizer's
EOS ids and take ``n`` = 1 only (422 otherwise: one completion a request). ``GET /v1/models``
lists the one model. With an API key (``--api-key`` or ``JZERO_API_KEY``) every ``/v1/`` call
needs ``Authorization: Bearer KEY`` (401 otherwise), as OpenAI-compatible servers do.
``GET /health`` says whether it takes requests, how busy it is and what the engine compiled
(each program and prompt bucket once: a recompile would show here).

Built on aiohttp: one well-kept asyncio library is both the server (streaming responses for
SSE, a body-size limit, graceful shutdown on SIGTERM built in, no separate ASGI server to run)
and the client the tests call it with. The engine runs in a thread of its own: handlers put
checked requests on a queue; the thread submits them to the `Scheduler`, steps it while
anything is in flight, and hands each token to its request's asyncio queue.

Shutdown on SIGTERM or SIGINT: the server stops listening and answers new requests 503, every
request in flight is finished (up to ``drain_s`` seconds; what is left then gets an error
event), and the engine thread stops. Errors are clean: 400 for a body that is not JSON, 413 for
one over the size limit, 422 naming the field for a value out of range.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import queue
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from jzero.inference import sampling, text
from jzero.inference.engine import Engine
from jzero.inference.scheduler import Event, Request, Scheduler

FINISH = {"length": "length", "context": "length", "stop": "stop"}  # ours -> OpenAI's finish_reason


@dataclass(frozen=True)
class Limits:
    """What one request may ask: tokens to generate, and the body's bytes."""

    max_tokens: int = 256
    max_body_bytes: int = 1 << 20


class FieldError(ValueError):
    """A request field out of range: a 422 naming it."""


def _field(body: dict, name: str, kind: type | tuple, default: Any) -> Any:
    value = body.get(name, default)
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise FieldError(f"{name}: expected {getattr(kind, '__name__', 'a number')}, got {json.dumps(value)}")
    return value


def chat_prompt(body: Any, tokenizer: text.Ids) -> list[int]:
    """The token ids of a chat body's ``messages`` rendered by the chat template (the template
    writes the special tokens itself, so the tokenizer adds none); FieldError naming the field."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise FieldError('messages: expected a non-empty list of {"role": "...", "content": "..."}')
    try:
        return tokenizer.encode(tokenizer.chat(messages, add_generation_prompt=True), special=False)
    except ValueError as e:
        raise FieldError(f"messages: {e}") from None


def parse(body: Any, tokenizer: text.Ids, max_len: int, limits: Limits,
          tokens: list[int] | None = None) -> tuple[Request, bool]:
    """(the request, whether to stream) of a completions body (``tokens``: a chat's rendered
    prompt instead of its ``prompt``); FieldError naming what is wrong."""
    if not isinstance(body, dict):
        raise FieldError("body: expected a JSON object")
    prompt, vocab_size = body.get("prompt"), tokenizer.vocab_size
    if tokens is not None:
        pass
    elif isinstance(prompt, str):
        try:
            tokens = tokenizer.encode(prompt)
        except ValueError as e:
            raise FieldError(f"prompt: {e}") from None
    elif isinstance(prompt, list) and all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt):
        tokens = prompt
    else:
        raise FieldError(f"prompt: expected a string or a list of token ids in 0..{vocab_size - 1}")
    if _field(body, "n", int, 1) != 1:
        raise FieldError(f"n: one completion a request (n = 1), got {body['n']}")
    max_tokens = _field(body, "max_tokens", int, 16)
    if not 1 <= max_tokens <= limits.max_tokens:
        raise FieldError(f"max_tokens: must be in 1..{limits.max_tokens}, got {max_tokens}")
    number = (int, float)
    settings = sampling.SamplingParams(float(_field(body, "temperature", number, 1.0)),
                                       _field(body, "top_k", int, 0), float(_field(body, "top_p", number, 1.0)))
    seed = _field(body, "seed", int, None) if "seed" in body else secrets.randbits(31)
    try:
        request = Request(tokens, max_tokens, settings, seed=seed, stop=tokenizer.eos).checked(max_len)
    except ValueError as e:
        raise FieldError(str(e)) from None
    return request, bool(_field(body, "stream", bool, False))


class Server:
    """The engine thread and the HTTP app around one `Engine`."""

    def __init__(self, engine: Engine, model_name: str, limits: Limits = Limits(), drain_s: float = 30.0,
                 tokenizer: text.Ids | None = None, api_key: str | None = None):
        self.engine, self.model_name, self.limits, self.drain_s = engine, model_name, limits, drain_s
        self.api_key = api_key
        self.tokenizer = tokenizer or text.for_model(engine.decoder.vocab_size)
        self.scheduler = Scheduler(engine)
        self.submissions: queue.Queue[Request] = queue.Queue()
        self.streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.ids = itertools.count()
        self.draining = False
        self.failed: str | None = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._engine_loop, name="jzero-engine", daemon=True)

    # --- the engine thread -----------------------------------------------------------------------
    def _engine_loop(self) -> None:
        try:
            while not self.stopped.is_set():
                try:
                    request = self.submissions.get(timeout=0 if self.scheduler.busy else 0.05)
                    self.scheduler.submit(request)
                    continue  # take every waiting submission before the next step
                except queue.Empty:
                    pass
                if self.scheduler.busy:
                    for event in self.scheduler.step():
                        self._deliver(event.id, event)
        except Exception as e:  # the engine failed: every request in flight ends with an error
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"jzero: serve: the engine failed: {self.failed}", file=sys.stderr, flush=True)
            for request_id in list(self.streams):
                self._deliver(request_id, None)

    def _deliver(self, request_id: int, event: Event | None) -> None:
        """Hand ``event`` (None: an error) to its request's handler, if it is still waiting."""
        entry = self.streams.get(request_id)
        if entry is not None:  # its client may be gone
            loop, events = entry
            loop.call_soon_threadsafe(events.put_nowait, event)

    # --- HTTP ------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes, middlewares=[self._authorized])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._start)
        app.on_shutdown.append(self._drain)
        app.on_cleanup.append(self._stop)
        return app

    @web.middleware
    async def _authorized(self, http: web.Request, handler: Any) -> web.StreamResponse:
        """401 for a ``/v1/`` call without the API key (when the server has one)."""
        given = http.headers.get("Authorization", "")
        if self.api_key and http.path.startswith("/v1/") and not secrets.compare_digest(
                given.encode(), f"Bearer {self.api_key}".encode()):
            return _error(401, "Authorization: expected 'Bearer <the server's API key>'")
        return await handler(http)

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "jzero"}]})

    async def _start(self, _: web.Application) -> None:
        self.thread.start()

    async def _drain(self, _: web.Application) -> None:
        self.draining = True
        deadline = time.monotonic() + self.drain_s
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self.streams):
            self._deliver(request_id, None)  # what is left ends with an error

    async def _stop(self, _: web.Application) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)

    async def health(self, _: web.Request) -> web.Response:
        busy = {"active": sum(s is not None for s in self.scheduler.slots), "waiting": len(self.scheduler.waiting),
                "slots": self.engine.slots, "compiles": [[c.name, *c.shape] for c in self.engine.compiles]}
        if self.failed or self.draining:
            status = f"failed: {self.failed}" if self.failed else "draining"
            return web.json_response({"status": status, **busy}, status=503)
        return web.json_response({"status": "ok", "model": self.model_name, **busy})

    async def completions(self, http: web.Request) -> web.StreamResponse:
        return await self._answer(http, chat=False)

    async def chat_completions(self, http: web.Request) -> web.StreamResponse:
        return await self._answer(http, chat=True)

    async def _answer(self, http: web.Request, chat: bool) -> web.StreamResponse:
        if self.failed or self.draining:
            return _error(503, f"the engine failed: {self.failed}" if self.failed else "the server is shutting down")
        try:
            body = json.loads(await http.read())
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"body: over the {self.limits.max_body_bytes} bytes a request may send")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"body: not valid JSON ({e})")
        try:
            tokens = chat_prompt(body, self.tokenizer) if chat else None
            request, stream = parse(body, self.tokenizer, self.engine.decoder.max_len, self.limits, tokens)
        except FieldError as e:
            return _error(422, str(e))
        request.id = next(self.ids)
        events: asyncio.Queue = asyncio.Queue()
        self.streams[request.id] = (asyncio.get_running_loop(), events)
        try:
            self.submissions.put(request)
            return await (self._stream(http, request, events, chat) if stream else self._whole(request, events, chat))
        finally:
            del self.streams[request.id]

    def _chunk(self, request: Request, text: str, tokens: list[int], finish: str | None, chat: bool = False,
               whole: bool = True, first: bool = False) -> dict:
        """A completion (``whole``) or one streamed chunk of it (the ``first`` says the role), in
        OpenAI's text or chat shape."""
        choice: dict[str, Any] = {"index": 0, "token_ids": tokens, "finish_reason": finish}
        if not chat:
            choice["text"] = text
        elif whole:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        kind = ("chat.completion" if whole else "chat.completion.chunk") if chat else "text_completion"
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request.id}", "object": kind, "created": int(time.time()),
                "model": self.model_name, "choices": [choice]}

    async def _whole(self, request: Request, events: asyncio.Queue, chat: bool) -> web.Response:
        words, tokens = self.tokenizer.detokenizer(), []
        while True:
            event = await events.get()
            if event is None:
                return _error(503, "the server shut down before the completion finished")
            tokens.append(event.token)
            if event.finished:
                body = self._chunk(request, words.of(tokens), tokens, FINISH[event.finished], chat)
                body["seed"] = request.seed
                body["usage"] = {"prompt_tokens": len(request.prompt), "completion_tokens": len(tokens),
                                 "total_tokens": len(request.prompt) + len(tokens)}
                return web.json_response(body)

    async def _stream(self, http: web.Request, request: Request, events: asyncio.Queue,
                      chat: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(http)
        words, sent = self.tokenizer.detokenizer(), 0
        while True:
            event = await events.get()
            if event is None:
                await response.write(b'data: {"error": "the server shut down before the completion finished"}\n\n')
                break
            piece = words.piece(event.token) + (words.flush() if event.finished else "")
            sent += 1
            chunk = self._chunk(request, piece, [event.token], FINISH.get(event.finished), chat, whole=False,
                                first=sent == 1)
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if event.finished:
                await response.write(b"data: [DONE]\n\n")
                break
        await response.write_eof()
        return response


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def serve(engine: Engine, model_name: str, host: str, port: int, limits: Limits, drain_s: float,
          tokenizer: text.Ids | None = None, api_key: str | None = None) -> None:
    """Run the server until SIGTERM or SIGINT (module docstring)."""
    server = Server(engine, model_name, limits, drain_s, tokenizer, api_key)
    web.run_app(server.app(), host=host, port=port, shutdown_timeout=drain_s + 5, handle_signals=True,
                print=lambda _: print(f"jzero: serving {model_name} on http://{host}:{port} "
                                      f"({engine.slots} slots); SIGTERM or Ctrl-C stops it", flush=True))
    seconds = sum(c.seconds for c in engine.compiles)
    print(f"jzero: serve compiled {len(engine.compiles)} programs ({seconds:.1f} s): "
          + ", ".join(f"{c.name}{list(c.shape) if c.shape else ''}" for c in engine.compiles), flush=True)
