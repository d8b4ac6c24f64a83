"""One worker process per rank, driven over loopback sockets: :class:`RemoteEngine`.

The driver (the ``LLM`` or the server) listens on ``127.0.0.1`` (or the interface the operator
names), starts ``tp`` processes, and each rank joins a gloo world, builds the same engine
(:func:`~.engine_config.build_engine`, distributed executor) and connects back. Every call is sent to
every rank and answered by every rank, in order, as JSON frames (:mod:`.channel`): ranks run the
same deterministic engine on the same calls, so they stay in lockstep, and the driver checks that
their answers agree. ``RemoteEngine`` has the :class:`~dcpgraph.Engine` methods serving uses
(``add_request``, ``step``, ``abort``, ``generate``, ``memory_report``, ``report``).

Faults: a rank that exits, or a call unanswered within ``timeout_s``, raises
:class:`WorkerDiedError` within about a quarter second of being noticed; the group is then dead
(every later call raises it too) and its processes are killed.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from .. import errors
from ..runtime.engine_client import EngineClient, run_rank_op
from ..runtime.ports import free_port
from ..runtime.sampling_params import SamplingParams
from ..runtime.scheduler import StepEvent
from .channel import ChannelClosedError, recv_frame, send_frame
from .engine_config import EngineConfig, build_engine
from .kv_connector import rank_ops  # noqa: F401  (registers the KV transfer's rank ops on every worker)


class WorkerDiedError(RuntimeError):
    """A worker process died or stopped answering; the engine cannot continue."""


def error_record(err: BaseException) -> dict:
    return {"type": type(err).__name__, "message": str(err)}


def raise_error_record(record: dict) -> None:
    """Re-raise a worker's error: a :class:`~dcpgraph.errors.DcpGraphError` subclass (e.g. a
    ``RequestError`` subclass such as a queue-full error) keeps its class, anything else is a
    ``RuntimeError`` naming the original type."""
    cls = getattr(errors, record["type"], None)
    if isinstance(cls, type) and issubclass(cls, errors.DcpGraphError):
        raise cls(record["message"])
    raise RuntimeError(f"{record['type']}: {record['message']}")


# -- the worker side ------------------------------------------------------------------------------
def _handle(engine, message: dict) -> dict:
    op = message["op"]
    if op == "add":
        rid = engine.add_request(message["prompt"], message["max_new_tokens"], **message["sampling"])
        return {"rid": rid}
    if op == "step":
        start = time.perf_counter()
        events = engine.step()
        return {"events": [[int(r), int(t), bool(f)] for r, t, f in events],
                "logprobs": [e.logprobs for e in events], "seconds": time.perf_counter() - start}
    if op == "abort":
        return {"aborted": bool(engine.abort(message["rid"]))}
    if op == "memory_report":
        return {"value": engine.memory_report()}
    if op == "report":
        return {"value": engine.report()}
    if op == "rank_call":  # e.g. the prefill/decode transfer's steps (serving/kv_connector/rank_ops.py)
        return {"value": run_rank_op(engine, message["name"], message["args"])}
    if op == "generate":
        return {"value": engine.generate(message["prompts"], message["max_new_tokens"], **message["sampling"])}
    if op == "kv_usage":
        used, total = engine.kv_usage_per_rank()[0]
        return {"used": used, "total": total}
    raise ValueError(f"unknown op {op!r}")


def worker_main(rank: int, world: int, dist_port: int, driver: tuple[str, int], config: dict, timeout_s: float) -> None:
    """A rank: connect to the driver, join the world, build the engine, then answer calls until
    ``shutdown`` or the driver goes away."""
    torch.set_num_threads(1)
    sock = socket.create_connection(driver)
    send_frame(sock, {"rank": rank, "pid": os.getpid()})
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://{driver[0]}:{dist_port}",
                                timeout=datetime.timedelta(seconds=timeout_s))
        engine = build_engine(EngineConfig.from_json(config), executor="distributed")
    except BaseException as err:
        send_frame(sock, {"ok": False, "error": error_record(err), "traceback": traceback.format_exc()})
        return
    send_frame(sock, {"ok": True})
    while True:
        try:
            message = recv_frame(sock)
        except (ChannelClosedError, OSError):
            return
        if message.get("op") == "shutdown":
            send_frame(sock, {"ok": True})
            return
        try:
            reply = _handle(engine, message)
        except Exception as err:
            reply = {"error": error_record(err)}
        send_frame(sock, reply)


# -- the driver side ------------------------------------------------------------------------------
class RemoteEngine(EngineClient):
    def __init__(self, config: EngineConfig, *, host: str = "127.0.0.1", timeout_s: float = 600.0,
                 start_method: str | None = None):
        import torch.multiprocessing as mp

        self.config = config
        self.timeout_s = timeout_s
        self.dead: str | None = None
        self.last_step_rank_seconds: list[float] = []  # each rank's own time in its last step
        world = config.tensor_parallel_size
        if start_method is None:
            start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((host, 0))
        listener.listen(world)
        driver = listener.getsockname()[:2]
        dist_port = free_port(host)
        self.procs = [ctx.Process(target=worker_main, name=f"dcpgraph-worker{rank}", daemon=True,
                                  args=(rank, world, dist_port, driver, config.to_json(), timeout_s))
                      for rank in range(world)]
        self.socks: list[socket.socket | None] = [None] * world
        self.pids: list[int] = [0] * world
        try:
            for proc in self.procs:
                proc.start()
            self._accept(listener, time.monotonic() + timeout_s)
            for sock in self.socks:
                hello = recv_frame(sock, timeout_s=timeout_s, alive=self._alive)
                if not hello["ok"]:
                    raise_error_record(hello["error"])
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()

    def _accept(self, listener: socket.socket, deadline: float) -> None:
        listener.settimeout(0.25)
        pending = len(self.procs)
        while pending:
            if time.monotonic() > deadline:
                raise WorkerDiedError("workers did not connect in time")
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                if not self._alive():
                    raise WorkerDiedError(f"a worker exited while starting (exit codes {self.exit_codes()})") from None
                continue
            first = recv_frame(sock, timeout_s=30, alive=self._alive)
            self.socks[first["rank"]] = sock
            self.pids[first["rank"]] = first["pid"]
            pending -= 1

    def _alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def exit_codes(self) -> list[int | None]:
        return [p.exitcode for p in self.procs]

    def _call(self, message: dict) -> list[dict]:
        if self.dead:
            raise WorkerDiedError(self.dead)
        try:
            for sock in self.socks:
                send_frame(sock, message)
            replies = [recv_frame(sock, timeout_s=self.timeout_s, alive=self._alive) for sock in self.socks]
        except (ChannelClosedError, OSError, TimeoutError) as err:
            self.dead = f"worker group failed during {message['op']!r}: {err} (exit codes {self.exit_codes()})"
            self.close()
            raise WorkerDiedError(self.dead) from None
        for reply in replies:
            if "error" in reply:
                raise_error_record(reply["error"])
        return replies

    def _agreed(self, message: dict, key: str) -> Any:
        return self._check_agree(message["op"], [r[key] for r in self._call(message)])

    def _check_agree(self, op: str, values: list) -> Any:
        if any(v != values[0] for v in values[1:]):
            self.dead = f"ranks disagree on {op!r}: {values}"
            self.close()
            raise WorkerDiedError(self.dead)
        return values[0]

    # -- Engine's interface ----------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], max_new_tokens: int, *, params=None, **sampling: Any) -> int:
        if params is not None:  # ranks take the JSON-able keywords of the same request
            sampling = SamplingParams.for_engine(params, **sampling).engine_params()
        return self._agreed({"op": "add", "prompt": [int(t) for t in prompt], "max_new_tokens": max_new_tokens,
                             "sampling": sampling}, "rid")

    def step(self) -> list[StepEvent]:
        """Every rank's events (checked equal); log-probabilities are rank 0's: every rank samples
        the same token from the same gathered logits, and rank 0's computed them."""
        replies = self._call({"op": "step"})
        self.last_step_rank_seconds = [float(r["seconds"]) for r in replies]
        events = self._check_agree("step", [r["events"] for r in replies])
        return [StepEvent(r, t, f, lp) for (r, t, f), lp in zip(events, replies[0]["logprobs"], strict=True)]

    def abort(self, request_id: int) -> bool:
        return self._agreed({"op": "abort", "rid": int(request_id)}, "aborted")

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, **sampling: Any) -> list[list[int]]:
        """:meth:`Engine.generate <dcpgraph.runtime.engine.Engine.generate>` on every rank (checked equal)."""
        return self._agreed({"op": "generate", "prompts": [[int(t) for t in p] for p in prompts],
                             "max_new_tokens": max_new_tokens, "sampling": sampling}, "value")

    def memory_report(self) -> dict:
        return self._call({"op": "memory_report"})[0]["value"]

    def report(self) -> dict:
        return self._call({"op": "report"})[0]["value"]

    def rank_call(self, name: str, args: dict) -> list:
        """A rank op (:mod:`dcpgraph.runtime.engine_client`) on every rank at once; one value per rank."""
        return [r["value"] for r in self._call({"op": "rank_call", "name": name, "args": args})]

    def healthy(self) -> bool:
        return not self.dead and self._alive()

    def worker_pids(self) -> list[int]:
        return list(self.pids)

    def kv_usage_per_rank(self) -> list[tuple[int, int]]:
        return [(r["used"], r["total"]) for r in self._call({"op": "kv_usage"})]

    def close(self) -> None:
        """Ask every rank to stop, then make sure: join briefly, kill what is left."""
        for sock in self.socks:
            if sock is None:
                continue
            try:
                if not self.dead:
                    send_frame(sock, {"op": "shutdown"})
                    recv_frame(sock, timeout_s=5, alive=self._alive)
            except (ChannelClosedError, OSError, TimeoutError):
                pass
            sock.close()
        self.socks = [None] * len(self.socks)
        self.dead = self.dead or "the worker group was shut down"
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
