"""Continuous batching over an `Engine`: requests join free slots as they arrive and leave when done.

Each `Scheduler.step` is one iteration of DeepSpeed-FastGen's Dynamic SplitFuse, in the form a
fixed-shape XLA program allows: first one `Engine.generate` for every active slot (decode tokens
go first, so a running request never waits behind a prompt), then prompt chunks fill what is left
of ``token_budget`` (budget minus the decode tokens). A long prompt is prefilled a chunk per
iteration into its own prefix and inserted into its slot when complete, so decoding continues
between its chunks instead of stalling for the whole prompt. FastGen fuses decode tokens and
chunks into one ragged forward; on XLA that batch would be padded to ``[slots, chunk]`` (the
decode rows mostly padding), so the two run as their own compiled shapes in the same iteration.

``static=True`` is the baseline continuous batching is measured against: a batch of up to
``slots`` waiting requests is admitted only when every slot is idle, prefilled whole, and
decoded until its last request finishes.

A request ends at ``max_tokens`` tokens (reason ``"length"``), on its ``stop`` token (``"stop"``,
the stop token is emitted) or when its context reaches the model's ``max_len`` (``"context"``).
"""
from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from jzero.inference import sampling
from jzero.inference.engine import Engine, Prefix


@dataclass
class Request:
    """One generation: ``prompt`` token ids, at most ``max_tokens`` new ones, sampled with
    ``settings`` from ``seed``; ``stop``: tokens that end it (a tokenizer's EOS ids; none: none)."""

    prompt: np.ndarray
    max_tokens: int
    settings: sampling.SamplingParams = sampling.SamplingParams()
    seed: int = 0
    stop: tuple[int, ...] = ()
    id: int = 0
    arrival: float = 0.0

    def checked(self, max_len: int) -> Request:
        """Itself, or ValueError naming the field that is out of range."""
        self.prompt = np.asarray(self.prompt, np.int32).reshape(-1)
        if not 1 <= len(self.prompt) <= max_len:
            raise ValueError(f"prompt: 1 to {max_len} tokens (the model's context), got {len(self.prompt)}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        self.settings.checked()
        self.stop = (self.stop,) if isinstance(self.stop, int) else tuple(self.stop or ())
        return self


@dataclass
class Event:
    """A token of request ``id``; ``finished``: the reason it ended with this token, or None."""

    id: int
    token: int
    finished: str | None = None


@dataclass
class Progress:
    """A request in the scheduler: its tokens so far and when things happened (clock seconds)."""

    request: Request
    tokens: list[int] = field(default_factory=list)
    first_token: float | None = None
    finished: float | None = None
    reason: str | None = None


class Scheduler:
    """Continuous batching (or ``static``) over ``engine``; ``token_budget``: tokens per iteration
    (default: the engine's chunk plus its slots)."""

    def __init__(self, engine: Engine, token_budget: int | None = None, static: bool = False,
                 clock: Callable[[], float] = time.perf_counter):
        self.engine, self.static, self.clock = engine, static, clock
        self.token_budget = engine.chunk + engine.slots if token_budget is None else token_budget
        if self.token_budget <= engine.slots and not static:
            raise ValueError(f"token_budget: must exceed the {engine.slots} slots (decode tokens come first), "
                             f"got {self.token_budget}")
        self.state = engine.empty_state()
        self.waiting: collections.deque[Progress] = collections.deque()
        self.slots: list[Progress | None] = [None] * engine.slots
        self.prefilling: tuple[Progress, int, Prefix, int] | None = None  # progress, slot, prefix, tokens done
        self.progress: dict[int, Progress] = {}

    def submit(self, request: Request) -> Progress:
        """Queue ``request`` (checked); its `Progress` fills in as `step` runs."""
        if request.id in self.progress:
            raise ValueError(f"request id {request.id} is already in the scheduler")
        progress = Progress(request.checked(self.engine.decoder.max_len))
        self.progress[request.id] = progress
        self.waiting.append(progress)
        return progress

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self.prefilling is not None or any(s is not None for s in self.slots)

    def step(self) -> list[Event]:
        """One iteration: a decode step for the active slots, then prompt chunks (module docstring)."""
        events = self._decode() if any(s is not None for s in self.slots) else []
        if self.static:
            if all(s is None for s in self.slots):
                while self.waiting and None in self.slots:
                    events += self._prefill(None)[1]
            return events
        budget = self.token_budget - sum(s is not None for s in self.slots)
        while budget > 0 and (self.prefilling is not None or (self.waiting and None in self.slots)):
            used, new = self._prefill(budget)
            if not used:
                break
            budget -= used
            events += new
        return events

    def run(self, requests: Iterable[Request]) -> list[Progress]:
        """Every request submitted once the clock passes its ``arrival`` and served to the end."""
        pending = collections.deque(sorted(requests, key=lambda r: r.arrival))
        done = []
        while pending or self.busy:
            while pending and pending[0].arrival <= self.clock():
                done.append(self.submit(pending.popleft()))
            if self.busy:
                self.step()
            else:
                time.sleep(max(0.0, min(pending[0].arrival - self.clock(), 0.01)))
        return done

    # --- internals -------------------------------------------------------------------------------
    def _prefill(self, budget: int | None) -> tuple[int, list[Event]]:
        """The next chunk of the prompt being prefilled (a whole prompt when ``budget`` is None);
        (tokens used, events)."""
        if self.prefilling is None:
            slot = self.slots.index(None)
            progress = self.waiting.popleft()
            self.slots[slot] = progress  # reserved: no other prompt takes it
            self.prefilling = (progress, slot, self.engine.start(progress.request.settings, progress.request.seed), 0)
        progress, slot, prefix, done = self.prefilling
        prompt = progress.request.prompt
        left = len(prompt) - done
        n = left if budget is None else min(left, self.engine.chunk, budget)
        if n < left and n < self.engine.min_bucket:
            return 0, []  # not worth a padded chunk: next iteration
        prefix = (self.engine.prefill_all if budget is None else self.engine.prefill)(prefix, prompt[done: done + n])
        if done + n < len(prompt):
            self.prefilling = (progress, slot, prefix, done + n)
            return n, []
        self.prefilling = None
        self.state = self.engine.insert(prefix, self.state, slot)
        return n, [self._emit(slot, int(prefix.token))]

    def _decode(self) -> list[Event]:
        self.state, step = self.engine.generate(self.state)
        tokens = np.asarray(step.tokens)
        return [self._emit(slot, int(tokens[slot]))
                for slot, progress in enumerate(self.slots)
                if progress is not None and progress.first_token is not None]

    def _emit(self, slot: int, token: int) -> Event:
        """Record ``token`` for the request in ``slot`` and retire the slot if the request is done
        (its context, the prompt and every token so far, has no room to feed this one back)."""
        progress, now = self.slots[slot], self.clock()
        progress.tokens.append(token)
        progress.first_token = now if progress.first_token is None else progress.first_token
        request = progress.request
        reason = ("stop" if token in request.stop else "length" if len(progress.tokens) >= request.max_tokens
                  else "context" if len(request.prompt) + len(progress.tokens) > self.engine.decoder.max_len
                  else None)
        if reason is not None:
            progress.finished, progress.reason = now, reason
            self.slots[slot] = None
            self.state = self.engine.retire(self.state, slot)
        return Event(request.id, token, reason)


def stream(engine: Engine, request: Request) -> Iterator[int]:
    """``request``'s tokens as they are sampled, on an engine of its own."""
    scheduler = Scheduler(engine)
    scheduler.submit(request)
    while scheduler.busy:
        yield from (event.token for event in scheduler.step())
