"""``EngineLoop``: the one thread that touches the engine, feeding per-request asyncio queues.

The engine is not thread-safe and a :class:`~.workers.RemoteEngine` is one conversation with its
ranks, so every engine call (add, step, abort, reports) happens on this thread. HTTP handlers
submit commands through a thread-safe queue and receive :class:`Piece` items on an
``asyncio.Queue`` of their own (``loop.call_soon_threadsafe``). Invariants:

- every submitted request ends with exactly one final piece: ``finished`` (with a finish reason)
  or ``error`` (the engine died); an aborted request gets nothing more;
- a request a stop string ended is aborted in the engine at once, so its blocks are freed;
- once the engine fails (a worker died, a step raised) the loop never steps again: every live
  request gets an error piece, every later submission fails, and :attr:`error` says why.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from ..errors import DcpGraphError
from ..runtime.engine_client import WAITING_IDS
from .detokenizer import TextStream
from .metrics import FinishedRequest, Metrics
from .params import SamplingParams

log = logging.getLogger("dcpgraph.serving")
SNAPSHOT_EVERY_S = 0.5
LIVENESS_EVERY_S = 0.5  # between steps, how often the engine's processes are checked


class EngineDeadError(DcpGraphError, RuntimeError):
    """The engine failed earlier (see the message); the server cannot generate any more."""


@dataclass
class Piece:
    choice: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[dict] = field(default_factory=list)  # per token of token_ids, when requested
    prompt_logprobs: list | None = None  # per prompt token (None first), on a choice's first piece when requested
    kv_transfer_params: dict | None = None  # a producer's hand-over (P/D), on its final piece
    engine: int = 0  # the engine (data-parallel replica) that runs the choice


@dataclass
class _Live:
    choice: int
    stream: TextStream
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    prompt_tokens: int
    log_id: str
    arrived: float
    max_tokens: int | None = None
    scheduled: float | None = None  # the start of the engine step that first scheduled it
    first: float | None = None
    last: float | None = None
    produce: bool = False  # P/D producer: hold the KV after the first token instead of finishing
    engine: int = 0  # the engine (data-parallel replica) that runs it: the metrics' ``engine`` label


class EngineLoop:
    def __init__(self, llm, metrics: Metrics, kv_agent=None):
        self.llm = llm
        self.kv_agent = kv_agent
        self.engine = llm.engine
        self.metrics = metrics
        self.error: str | None = None
        self._commands: queue.Queue = queue.Queue()
        self._live: dict[int, _Live] = {}
        self._snapshot = {"running": 0, "waiting": 0, "kv_usage": [0.0] * llm.config.tensor_parallel_size,
                          "kv_blocks": [], "prefix_cache": {}, "scheduler": {}, "engines": []}
        self._snapshot_at = 0.0
        self._checked_at = 0.0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dcpgraph-engine-loop", daemon=True)
        self._thread.start()

    # -- called from the event loop ------------------------------------------------------------
    async def submit(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int, index: int, choice: int,
                     out: asyncio.Queue, log_id: str, kv_transfer: dict | None = None) -> int:
        """Queue one completion; returns the engine's request id or raises its ``RequestError``
        (``kv_transfer``: P/D parameters, see :mod:`.kv_connector.agent`)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(("add", prompt_ids, params, max_tokens, index, choice, out, log_id, loop, done, kv_transfer))
        return await done

    def abort(self, request_id: int) -> None:
        self._commands.put(("abort", request_id))

    async def call(self, fn):
        """``fn(engine)`` run on the engine thread between steps (the engine is not thread-safe);
        its result, or its exception raised here."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(("call", fn, loop, done))
        return await done

    def snapshot(self) -> dict:
        return dict(self._snapshot)

    @property
    def healthy(self) -> bool:
        if self.error is not None or not self._thread.is_alive():
            return False
        return self.engine.healthy()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(10)

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                if not self._live:  # idle: wait briefly for work instead of spinning
                    try:  # (a producer holding KV checks for consumers' asks more often)
                        wait = 0.01 if self.kv_agent is not None and self.kv_agent.held else 0.1
                        self._handle(self._commands.get(timeout=wait))
                    except queue.Empty:
                        pass
                while True:
                    try:
                        self._handle(self._commands.get_nowait())
                    except queue.Empty:
                        break
                self._check_alive()
                if self.kv_agent is not None and self.error is None:
                    self.kv_agent.tick()
                if self._live and self.error is None:
                    self._step()
                self._refresh_snapshot()
            except Exception as err:  # the engine or a worker failed: nothing can run any more
                self._fail(err)

    def _handle(self, command: tuple) -> None:
        if command[0] == "call":
            _, fn, loop, done = command
            try:
                result = fn(self.engine)
            except Exception as err:
                loop.call_soon_threadsafe(_set_exception, done, err)
                return
            loop.call_soon_threadsafe(_set_result, done, result)
            return
        if command[0] == "abort":
            live = self._live.pop(command[1], None)
            if live is not None and self.error is None:
                self.engine.abort(command[1])
                log.info("request %s: aborted (client went away)", live.log_id)
                self._record(live, "abort")
            return
        _, prompt_ids, params, max_tokens, index, choice, out, log_id, loop, done, kv = command
        self._check_alive(now=True)
        if self.error is not None:
            loop.call_soon_threadsafe(_set_exception, done, EngineDeadError(self.error))
            return
        produce, received = bool(kv and kv.get("do_remote_decode")), ()
        try:
            if kv and "transfer_id" in kv:
                rid, received = self.kv_agent.receive(prompt_ids, max_tokens, params.engine_params(index), kv)
            else:  # a producer's request keeps room for one more token, so it is held, not finished
                rid = self.engine.add_request(prompt_ids, 2 if produce else max_tokens, **params.engine_params(index))
        except (DcpGraphError, ValueError) as err:
            loop.call_soon_threadsafe(_set_exception, done, err)
            return
        except Exception as err:
            loop.call_soon_threadsafe(_set_exception, done, EngineDeadError(str(err)))
            raise
        live = _Live(choice, TextStream(self.llm.tokenizer, params, self.llm.eos_token_ids), loop, out,
                     len(prompt_ids), log_id, time.monotonic(), max_tokens=max_tokens, produce=produce,
                     engine=self.engine.engine_of(rid))
        self._live[rid] = live
        loop.call_soon_threadsafe(_set_result, done, rid)
        if received:  # the producer's tokens are this response's first ones
            live.scheduled = live.first = live.last = time.monotonic()
            self.metrics.first_token(live.first - live.arrived, live.engine)
            self.metrics.step_done(live.prompt_tokens, len(received), live.engine)
            piece = Piece(choice, "".join(live.stream.add(t, False) for t in received), list(received),
                          engine=live.engine)
            if live.stream.finished:  # only a stop condition the producer did not apply ends it here
                piece.finished, piece.finish_reason = True, live.stream.finish_reason
                del self._live[rid]
                self.engine.abort(rid)
                self._record(live, live.stream.finish_reason)
            _post(loop, out, piece)

    def _step(self) -> None:
        started = time.monotonic()
        events = self.engine.step()
        now = time.monotonic()
        self._mark_scheduled(started)
        pieces: dict[int, tuple[_Live, Piece]] = {}
        for event in events:
            rid, token, engine_finished = event
            live = self._live.get(rid)
            if live is None:  # aborted, or already ended by a stop string earlier in this step
                continue
            if rid not in pieces:
                self._timing(live, started, now)
            _, piece = pieces.setdefault(rid, (live, Piece(live.choice, engine=live.engine)))
            piece.text += live.stream.add(token, engine_finished or live.produce)
            piece.token_ids.append(token)
            if event.logprobs is not None:
                piece.logprobs.append(event.logprobs)
            if event.prompt_logprobs is not None:
                piece.prompt_logprobs = event.prompt_logprobs
            if live.stream.finished:
                piece.finished, piece.finish_reason = True, live.stream.finish_reason
                del self._live[rid]
                if live.produce and not engine_finished and piece.finish_reason == "length":
                    piece.kv_transfer_params = self.kv_agent.hold(rid)
                elif not engine_finished:
                    self.engine.abort(rid)
                self._record(live, live.stream.finish_reason)
        tokens = defaultdict(lambda: [0, 0])  # engine -> [prompt tokens, generated tokens] of this step
        for live, piece in pieces.values():
            if len(live.stream.token_ids) == len(piece.token_ids):  # its first tokens: count its prompt
                tokens[live.engine][0] += live.prompt_tokens
            tokens[live.engine][1] += len(piece.token_ids)
        for engine, (prompt, generated) in sorted(tokens.items()):
            self.metrics.step_done(prompt, generated, engine)
        for live, piece in pieces.values():
            _post(live.loop, live.out, piece)

    def _mark_scheduled(self, started: float) -> None:
        """Stamp ``scheduled`` (the start of this step) on every live request the engine has taken
        from its waiting queue; asks the engine only while some request is not stamped yet."""
        unstamped = [live for live in self._live.values() if live.scheduled is None]
        if not unstamped:
            return
        waiting = set(self.engine.rank_call(WAITING_IDS, {})[0])
        for rid, live in self._live.items():
            if live.scheduled is None and rid not in waiting:
                live.scheduled = started

    def _timing(self, live: _Live, started: float, now: float) -> None:
        """A step emitted tokens for ``live``: its first token (TTFT) or one more inter-token gap."""
        if live.first is None:
            live.scheduled = live.scheduled or started
            live.first = now
            self.metrics.first_token(now - live.arrived, live.engine)
        else:
            self.metrics.inter_token(now - live.last, live.engine)
        live.last = now

    def _record(self, live: _Live, reason: str) -> None:
        """Report a finished or aborted request's phases (see :class:`~.metrics.FinishedRequest`)."""
        now, first = time.monotonic(), live.first
        self.metrics.request_done(FinishedRequest(
            finish_reason=reason, prompt_tokens=live.prompt_tokens, generation_tokens=len(live.stream.token_ids),
            e2e=now - live.arrived, queued=None if live.scheduled is None else live.scheduled - live.arrived,
            prefill=None if first is None else first - live.scheduled,
            decode=None if first is None else live.last - first, max_tokens=live.max_tokens, engine=live.engine))
        log.info("request %s: finished (%s), %d prompt + %d generated tokens", live.log_id, reason,
                 live.prompt_tokens, len(live.stream.token_ids))

    def _refresh_snapshot(self) -> None:
        now = time.monotonic()
        idle_changed = not self._live and self._snapshot["running"] + self._snapshot["waiting"] > 0
        if self.error is not None or (now - self._snapshot_at < SNAPSHOT_EVERY_S and not idle_changed):
            return
        speculative = bool(self.llm.settings.speculative.checked)
        engines = []
        for e, (usage, report) in enumerate(self.engine.engine_states()):
            blocks = [(int(u), int(t)) for u, t in usage]
            lives = [v for v in self._live.values() if v.engine == e]
            running = sum(1 for v in lives if v.scheduled is not None)
            engines.append({"running": running, "waiting": len(lives) - running, "kv_blocks": blocks,
                            "kv_usage": [u / t if t else 0.0 for u, t in blocks],
                            "prefix_cache": report["prefix_cache"], "scheduler": report["scheduler"],
                            "speculative": report["speculative"] if speculative else {},
                            "forwards": {"work": report.get("steps", 0), "dummy": report.get("dummy_steps", 0)}})
        self._snapshot = {**engines[0], "running": sum(x["running"] for x in engines),
                          "waiting": sum(x["waiting"] for x in engines),
                          "kv_blocks": [b for x in engines for b in x["kv_blocks"]],
                          "kv_usage": [u for x in engines for u in x["kv_usage"]], "engines": engines}
        self._snapshot_at = now

    def _check_alive(self, now: bool = False) -> None:
        """Fail the engine as soon as one of its processes is gone, not at its next step: a worker
        (or a data-parallel replica's worker) that dies while idle, or while only other replicas
        have work, leaves an engine that ``/health`` reports down, so it takes no new request and
        ends the ones in flight, as one replica does (vLLM's data-parallel engines fail together).
        Checked every :data:`LIVENESS_EVERY_S` between steps, and before each new request."""
        moment = time.monotonic()
        if self.error is not None or (not now and moment - self._checked_at < LIVENESS_EVERY_S):
            return
        self._checked_at = moment
        if not self.engine.healthy():
            self._fail(EngineDeadError("a worker process is not running"))

    def _fail(self, err: Exception) -> None:
        self.error = f"{type(err).__name__}: {err}"
        log.error("engine failed: %s; ending %d in-flight request(s)", self.error, len(self._live),
                  exc_info=(type(err), err, err.__traceback__))
        for live in self._live.values():
            _post(live.loop, live.out, Piece(live.choice, error=self.error))
        self._live.clear()


def _post(loop: asyncio.AbstractEventLoop, out: asyncio.Queue, piece: Piece) -> None:
    try:
        loop.call_soon_threadsafe(out.put_nowait, piece)
    except RuntimeError:  # the client's event loop is gone
        pass


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, err: BaseException) -> None:
    if not future.done():
        future.set_exception(err)
