"""Event loops that finish what they started: a failed Orbax read leaves no task behind.

Orbax runs each restore in a fresh asyncio loop (`run_until_complete`, then `close`) and reads
every array shard in a task under one `asyncio.gather`. When one shard cannot be read (a
truncated file), the gather fails at once and the loop is closed with the sibling reads still
pending. Those tasks are then finalised by the garbage collector at some later moment: closing
the coroutine raises `GeneratorExit` inside Orbax's ``except BaseException`` (which turns it into
a new exception), and TensorStore's finished reads call back into the closed loop; Python prints
each as "Exception ignored in ..." with a multi-page TensorStore spec. `draining` makes every
loop created while it is active cancel and await its pending tasks before it closes, as
`asyncio.run` does, so the failed restore ends cleanly when it returns, and drops the late
completions of reads it no longer waits for instead of raising in TensorStore's thread. Only
reads are abandoned there, never writes: what is discarded is data of a step already judged
unreadable.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()


class _DrainingLoop(asyncio.SelectorEventLoop):
    def call_soon_threadsafe(self, callback: Any, *args: Any, context: Any = None) -> Any:
        """A read finished after its task was cancelled (TensorStore completes it in its own
        thread) finds the loop closed: nobody waits for it, so it is dropped, not raised."""
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        except RuntimeError:
            if self.is_closed():
                return None
            raise

    def close(self) -> None:
        if not self.is_closed() and not self.is_running():
            pending = [t for t in asyncio.all_tasks(self) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()


class _DrainingPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return _DrainingLoop()


@contextlib.contextmanager
def draining() -> Iterator[None]:
    """Inside: every new asyncio event loop finishes its pending tasks when closed."""
    with _lock:
        previous = asyncio.get_event_loop_policy()
        asyncio.set_event_loop_policy(_DrainingPolicy())
        try:
            yield
        finally:
            asyncio.set_event_loop_policy(previous)
