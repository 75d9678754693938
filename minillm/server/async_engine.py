"""AsyncEngine: one LLMEngine stepping in a background thread, serving many asyncio callers.

    engine = AsyncEngine(LLMEngine(model, tokenizer), metrics)
    engine.start()
    async for out in engine.generate("req-1", prompt_ids, params):   # a RequestOutput per new token
        ...

The HTTP handlers live on the event loop; the model runs in the engine thread, so a forward pass
never blocks a connection. They talk through two queues:

    handler --(add / abort)--> commands --> engine thread: step(), step(), ...
    handler <--(RequestOutput)-- one asyncio.Queue per request <-- engine thread

The thread takes every pending command before each step, so a new request joins the very next
batch and an aborted one (a client that went away) gives its blocks back before it.

One thread runs the model, from loading to stepping: `python -m minillm serve` loads each model in
the thread that will step it (`engine_thread()`, then `AsyncEngine(..., runs_on=that thread)`). Each
thread that runs a parallel operator gets a team of OpenMP threads of its own; with a second team
(the main thread's, left from loading the model there) there are more OpenMP threads than cores, and
GNU OpenMP then lets a waiting thread spin only ~100 times before it sleeps, so every operator waits
for its helpers to wake: benchmarks/engine_thread.py measures what that costs a step.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import AsyncIterator

from ..engine import LLMEngine
from ..engine.request import RequestOutput
from ..sampling import SamplingParams

logger = logging.getLogger("minillm")


class QueueFull(Exception):
    """More requests are waiting than --max-queued-requests allows (HTTP 503)."""


def engine_thread() -> ThreadPoolExecutor:
    """A thread to build a model's engine in and then step it: `engine_thread().submit(build).result()`."""
    return ThreadPoolExecutor(1, thread_name_prefix="minillm-engine")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics=None, max_queued_requests: int | None = None,
                 runs_on: ThreadPoolExecutor | None = None):
        """runs_on: the thread (engine_thread()) that built the engine, to step it there; None: a new thread."""
        self.engine, self.metrics, self.runs_on = engine, metrics, runs_on
        self.max_queued_requests = max_queued_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending_adds = 0          # requests sent to the thread, not yet in the engine's queue
        self._pending_lock = threading.Lock()   # counted up by the event loop, down by the engine thread
        self._stop = False
        self._running: Future | None = None     # the loop, done when it ends
        self.error: BaseException | None = None     # what stopped the engine thread, if anything did

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.runs_on is not None:
            self._running = self.runs_on.submit(self._loop)
            return
        self._running = Future()

        def run():
            self._loop()
            self._running.set_result(None)
        threading.Thread(target=run, name="minillm-engine", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is still running (its streams end with finish_reason "abort") and end the thread."""
        self._stop = True
        self._wake.set()
        if self._running is not None:
            try:
                self._running.result(timeout)
            except TimeoutError:
                logger.warning("the engine thread did not stop within %.0f s", timeout)
        if self.runs_on is not None:
            self.runs_on.shutdown(wait=False)

    @property
    def healthy(self) -> bool:
        return self._running is not None and not self._running.done() and self.error is None

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._pending_adds

    # ------------------------------------------------------------ the handlers' side
    def check_room(self, k: int = 1) -> None:
        """Raise QueueFull if k more requests would overfill the waiting queue."""
        if self.max_queued_requests is not None and self.num_waiting + k > self.max_queued_requests:
            raise QueueFull(f"the server is busy: {self.num_waiting} requests are waiting "
                            f"(--max-queued-requests {self.max_queued_requests}); retry later")

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 n: int = 1) -> AsyncIterator[RequestOutput]:
        """Queue the request now (it counts against --max-queued-requests from this call on, before
        anything is read from it) and return its outputs, those of its n samples (ids request_id,
        request_id/1, ...), as they come, until all are finished. Leaving the loop early (a client
        gone) aborts them all."""
        ids = [request_id] + [f"{request_id}/{i}" for i in range(1, n)]
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for rid in ids:
            self._streams[rid] = (loop, q)
        with self._pending_lock:
            self._pending_adds += 1
        self._send(("add", request_id, prompt_ids, params, n))
        return self._outputs(request_id, ids, q)

    async def _outputs(self, request_id: str, ids: list[str], q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        open_ids = set(ids)
        try:
            while open_ids:
                out = await q.get()
                if out.finished:
                    open_ids.discard(out.request_id)
                yield out
        finally:
            for rid in ids:
                self._streams.pop(rid, None)
            if open_ids:
                self._send(("abort", request_id, ids))

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # ------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        eng, main = self.engine, threading.main_thread()
        try:
            while not self._stop and main.is_alive():    # (a program that ends without stop() ends it too)
                self._take_commands()
                if not eng.has_unfinished_requests():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                outs = eng.step()
                if self.metrics is not None:
                    self.metrics.on_step(eng, outs)
                self._deliver(*outs)
        except BaseException as e:   # a bug in a step: say so on /health and to every open stream
            self.error = e
            logger.exception("the engine thread stopped")
        try:
            for rid in list(eng.requests):
                eng.abort_request(rid)
            for out in eng.step():         # schedules nothing; reports the aborted requests
                self._deliver(out)
        except Exception:
            logger.exception("could not abort the remaining requests")
        for rid in list(self._streams):          # shutting down: aborted; the engine broken: an error (500)
            self._deliver(RequestOutput.failed(rid, [], "abort", "the server is shutting down") if self.error is None
                          else RequestOutput.failed(rid, [], "error", f"the engine stopped: {self.error!r}",
                                                               server_fault=True))

    def _take_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt_ids, params, n = cmd
                with self._pending_lock:
                    self._pending_adds -= 1
                try:
                    self.engine.add_request(rid, prompt_ids, params, n=n)
                except ValueError as e:     # checked by the handler first; this is the last guard
                    for i in range(n):
                        self._deliver(RequestOutput.failed(rid if i == 0 else f"{rid}/{i}", [], "error", str(e)))
            else:
                for rid in cmd[2]:
                    self.engine.abort_request(rid)

    def _deliver(self, *outs: RequestOutput) -> None:
        """Hand outputs to their streams: one wake-up of each event loop per step, not one per output."""
        by_loop: dict = {}
        for out in outs:
            # a finished request's route is dropped here too: a stream that was never read (its client
            # gone before the first byte) leaves nothing behind
            target = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:          # the event loop is closed (shutdown)
                pass


def _put_all(items) -> None:
    for q, out in items:
        q.put_nowait(out)

