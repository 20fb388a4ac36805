"""``AsyncLLM``: the engine behind an asyncio server.

One background task owns the engine. Each turn of its loop, under one ``asyncio.Lock``:

    apply pending aborts           # engine.abort_request(ids): their KV blocks return to the pool at once
    outputs = engine.step()        # in the engine's own worker thread: the event loop never runs model work
    route outputs                  # each RequestOutput goes to its request's asyncio.Queue

and sleeps on an ``asyncio.Event`` while the engine has nothing to do. Every call into the engine (steps, adding
requests) runs on one dedicated thread (``kvserve-engine``), as vLLM's engine core owns its own loop: a pool of
threads would hand consecutive steps to different threads, and each thread that starts OpenMP work keeps its own
team of OpenMP workers, so a step on another thread wakes a cold, sleeping team (and, before PyTorch sets the
thread count of a new thread, runs with OpenMP's default count). ``add_request`` takes the same lock, so the
engine is never touched by two threads at once; requests that arrive during a step are added before the next one
(the lock is FIFO). ``RequestStream.abort()`` is synchronous (safe inside ``finally`` of a cancelled task): it
drops the stream at once and the engine forgets the request before its next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from typing import Optional

from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.protocol import EngineDeadError, EngineShutdownError, ModelInfo, EngineClientBase
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "EngineShutdownError", "RequestStream"]


class RequestStream:
    """The outputs of one request, as an async iterator of ``RequestOutput`` (the last one has ``finished``).

    Iteration raises ``EngineShutdownError`` if the server shuts down first, ``EngineDeadError`` if the engine
    loop fails. ``abort()`` ends the request early (idempotent; a no-op once finished).
    """

    def __init__(self, request_id: str, owner: "AsyncLLM"):
        self.request_id = request_id
        self.finished = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._owner = owner

    def _put(self, item) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Stop generating for this request; its blocks are freed before the engine's next step. A consumer
        waiting on the stream (another task) sees its end (``StopAsyncIteration``)."""
        if not self.finished:
            self.finished = True
            self._queue.put_nowait(StopAsyncIteration())
            self._owner.abort(self.request_id)


class AsyncLLM(EngineClientBase):
    """Async front of one ``LLMEngine``: the ``EngineClient`` (``kvserve.engine.protocol``) over a local engine.

    Args:
        engine: the engine; from now on only this object may call it.
        stat_logger: optional object with ``record(outputs, engine, now)`` (called after every loop turn, under the
            lock, with the step's outputs, possibly empty; ``now`` in ``time.monotonic()`` seconds) and
            ``record_aborts(request_ids)`` (requests the engine dropped unfinished); e.g. ``PrometheusStatLogger``.

    Attributes:
        state_observer: optional object with ``observe(outputs, engine, now)`` and ``forget(request_ids)``, called
            like ``stat_logger.record`` / ``record_aborts`` (between steps, under the lock; it must not block);
            e.g. the dashboard's ``DashboardHub``. ``wake()`` makes the idle loop turn once, so it is called.

    Use ``await start()`` inside the running event loop before ``add_request``, ``await shutdown()`` at the end.
    """

    def __init__(self, engine: LLMEngine, stat_logger=None):
        info = ModelInfo(model_path=str(engine.model_path), max_model_len=engine.max_model_len,
                         vocab_size=engine.arch.vocab_size, eos_token_ids=tuple(engine.eos_token_ids),
                         has_chat_template=bool(engine.chat_template or engine.chat_format == "harmony"
                                                or getattr(engine.tokenizer, "chat_template", None)),
                         scheduling_policy=engine.config.scheduler_config.scheduling_policy,
                         chat_format=engine.chat_format)
        super().__init__(engine.tokenizer, info, engine.chat_template, engine.grammar_backend)
        self.engine = engine
        self.stat_logger = stat_logger
        self.state_observer = None
        self._streams: dict = {}
        self._pending_aborts: set = set()
        self._ids = itertools.count()
        self._lock: Optional[asyncio.Lock] = None
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None  # the engine's one thread
        self._accepting = True
        self._stopping = False
        self.dead_error: Optional[BaseException] = None

    @classmethod
    def from_engine_args(cls, stat_logger=None, **engine_args) -> "AsyncLLM":
        """Build the engine from flat arguments (see ``LLMEngine.from_engine_args``); loads the model."""
        return cls(LLMEngine.from_engine_args(**engine_args), stat_logger=stat_logger)

    # ------------------------------------------------------------------------------------------------ state
    @property
    def is_running(self) -> bool:
        """True while the loop is alive and new requests are accepted (false while draining)."""
        return self._task is not None and not self._task.done() and self._accepting and self.dead_error is None

    @property
    def num_streams(self) -> int:
        """Requests with a live stream (added, not finished, not aborted)."""
        return len(self._streams)

    # ------------------------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the background loop (idempotent). Must run inside the event loop that will serve requests."""
        if self._task is None:
            self._lock = asyncio.Lock()
            self._wake = asyncio.Event()
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-engine")
            self._task = asyncio.create_task(self._run(), name="kvserve-engine-loop")

    async def shutdown(self) -> None:
        """Refuse new requests, abort every in-flight one (its stream raises ``EngineShutdownError``), let the loop
        free their blocks, and wait for the loop to end (at most the step that is running)."""
        self._accepting = False
        self.abort_all()
        self._stopping = True
        if self._task is not None:
            self._wake.set()
            await self._task
        if self._executor is not None:
            self._executor.shutdown(wait=False)  # the loop has ended: nothing runs on it any more

    def drain(self) -> None:
        """Refuse new requests from now on (``add_request`` raises ``EngineShutdownError``; ``is_running`` turns
        false) and let the ones in flight run to their end; ``abort_all`` or ``shutdown`` ends those left. Only sets a
        flag: safe from a signal handler or another thread."""
        self._accepting = False

    def abort_all(self) -> None:
        """Abort every in-flight request; their streams raise ``EngineShutdownError``."""
        for rid, stream in list(self._streams.items()):
            stream._put(EngineShutdownError(f"request {rid} aborted: the server is shutting down"))
            self._pending_aborts.add(rid)
        self._streams.clear()
        if self._wake is not None:
            self._wake.set()

    # ------------------------------------------------------------------------------------------------ requests
    async def add_request(
        self,
        prompt,
        sampling_params: SamplingParams,
        request_id: Optional[str] = None,
        arrival_time: Optional[float] = None,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request in the engine and return its stream.

        Args:
            prompt: text or a list of token ids (see ``LLMEngine.add_request``). Text is tokenized on the engine's
                thread, between steps; the server tokenizes (and renders chat templates) in worker threads and passes
                ids, so a long prompt never holds up the other requests' steps.
            sampling_params: a validated ``SamplingParams``.
            request_id: unique id; default a fresh one.
            arrival_time: ``time.monotonic()`` seconds when the request reached the server (TTFT counts from here);
                default now.
            priority: lower is scheduled first under the ``priority`` scheduling policy.

        Raises:
            ValueError: the engine rejected the request (bad or too long prompt, duplicate id); nothing is queued.
            EngineShutdownError: the server is shutting down.
            EngineDeadError: the engine loop has failed.
        """
        self._check_accepting()
        rid = f"req-{next(self._ids)}" if request_id is None else str(request_id)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        stream = RequestStream(rid, self)
        async with self._lock:
            self._check_accepting()
            self._streams[rid] = stream
            try:
                await self._in_engine_thread(self.engine.add_request, prompt, sampling_params, rid, arrival, priority)
            except ValueError:
                self._streams.pop(rid, None)  # the engine queued nothing
                raise
            except BaseException:
                # cancelled while the worker thread may still have added it: make sure it is dropped
                stream.abort()
                raise
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request by id (synchronous; unknown or finished ids are ignored). The engine frees its blocks
        before its next step."""
        if self._streams.pop(request_id, None) is not None:
            self._pending_aborts.add(request_id)
            if self._wake is not None:
                self._wake.set()

    def wake(self) -> None:
        """Make the loop run one more turn (observers see the engine even while it is idle); never blocks."""
        if self._wake is not None:
            self._wake.set()

    def _check_accepting(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop failed: {self.dead_error!r}")
        if not self._accepting or self._task is None:
            raise EngineShutdownError("the server is shutting down" if self._task else "AsyncLLM.start() not called")

    # ------------------------------------------------------------------------------------------------ the loop
    async def _in_engine_thread(self, fn, *args):
        """``fn(*args)`` on the engine's thread; the event loop runs on meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                async with self._lock:
                    if self._pending_aborts:
                        ids, self._pending_aborts = list(self._pending_aborts), set()
                        engine.abort_request(ids)
                        if self.stat_logger is not None:
                            self.stat_logger.record_aborts(ids)
                        if self.state_observer is not None:
                            self.state_observer.forget(ids)
                    outputs = None
                    if engine.has_unfinished_requests():
                        outputs = await self._in_engine_thread(engine.step)
                    if self.stat_logger is not None:
                        self.stat_logger.record(outputs or [], engine, time.monotonic())
                    if self.state_observer is not None:
                        self.state_observer.observe(outputs or [], engine, time.monotonic())
                if outputs is None:
                    if self._stopping and not self._pending_aborts:
                        return
                    if not self._pending_aborts:
                        self._wake.clear()
                        await self._wake.wait()
                    continue
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:  # aborted while the step ran
                        if out.finished:  # ... and finished in it: nothing left to abort
                            self._pending_aborts.discard(out.request_id)
                        continue
                    stream._put(out)
                    if out.finished:
                        del self._streams[out.request_id]
                await asyncio.sleep(0)  # let handlers and new requests run between steps
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # an engine bug: fail every request loudly rather than hang them
            logger.exception("engine loop failed")
            self.dead_error = e
            for stream in self._streams.values():
                stream._put(EngineDeadError(f"the engine loop failed: {e!r}"))
            self._streams.clear()
