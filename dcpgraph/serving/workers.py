"""One worker process per rank, one engine among them: :class:`RemoteEngine`.

The process that serves (the ``LLM`` or the server: the front end) listens on ``127.0.0.1`` (or
the interface the operator names) and starts ``tp·pcp`` processes. Each rank connects back
(:mod:`multiprocessing.connection`, authenticated with a fresh key), takes its device (the node's
accelerator ``local_rank mod count``, or the host), joins the world (NCCL, HCCL or gloo) and
compiles the checkpoint's programs (:func:`~.engine_config.compile_rank`: every rank the same).
Rank 0 then builds the deployment's one :class:`~dcpgraph.Engine` (scheduler, block manager,
prefix cache, proposer, sampling), whose executors broadcast each step's packed inputs to the
other ranks (:mod:`dcpgraph.runtime.step_broadcast`); the other ranks only run steps. The front
end sends engine calls (``add_request``, ``step``, ``abort``, ``generate``, reports, rank ops) to
rank 0 alone; the other ranks' connections carry their start-up report and, when a rank fails,
its error.

Faults: a rank that exits, or a call unanswered within ``timeout_s``, raises
:class:`WorkerDiedError` within about a quarter second of being noticed (naming the errors the
ranks reported); the group is then dead (every later call raises it too) and its processes are
killed.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

from .. import errors
from ..api import engine_for
from ..devices import DeviceKind, DeviceProbe, RankPlacement, place_rank
from ..runtime.distributed import FORKSERVER_PRELOAD, join_expert_group
from ..runtime.engine_client import EngineClient
from ..runtime.sampling_params import SamplingParams
from ..runtime.scheduler import StepEvent
from ..runtime.step_broadcast import ControlGroup, driver_executors, follow
from .engine_config import EngineConfig, compile_rank
from .kv_connector import rank_ops  # noqa: F401  (registers the KV transfer's rank ops on every worker)
from .nodes import NodeLayout, ReplicaPlacement

POLL_S = 0.25


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
def _handle(engine, message: dict, control: ControlGroup) -> dict:
    op = message["op"]
    if op == "add":
        rid = engine.add_request(message["prompt"], message["max_new_tokens"], **message["sampling"])
        return {"rid": rid}
    if op == "step":
        start, broadcast = time.perf_counter(), control.broadcast_seconds
        events = engine.step()
        return {"events": [(int(e[0]), int(e[1]), bool(e[2]), e.logprobs, e.prompt_logprobs) for e in events],
                "seconds": time.perf_counter() - start, "broadcast_seconds": control.broadcast_seconds - broadcast}
    if op == "abort":
        return {"aborted": bool(engine.abort(message["rid"]))}
    if op == "structured_outputs":
        engine.enable_structured_outputs(message["backend"])
        return {}
    if op == "memory_report":
        return {"value": engine.memory_report()}
    if op == "report":
        return {"value": engine.report()}
    if op == "rank_call":  # e.g. the prefill/decode transfer's steps (serving/kv_connector/rank_ops.py)
        return {"value": engine.rank_call(message["name"], message["args"])}
    if op == "generate":
        return {"value": engine.generate(message["prompts"], message["max_new_tokens"], **message["sampling"])}
    if op == "kv_usage":
        return {"value": engine.kv_usage_per_rank()}
    raise ValueError(f"unknown op {op!r}")


def _drive(conn: Connection, engine, control: ControlGroup) -> None:
    """Rank 0: answer the front end's calls until ``shutdown`` or the front end goes away, then stop
    the followers."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message.get("op") == "shutdown":
            control.broadcast(("stop",))
            conn.send({"ok": True})
            return
        try:
            reply = _handle(engine, message, control)
        except Exception as err:  # noqa: BLE001 - the front end raises it
            reply = {"error": error_record(err)}
        conn.send(reply)
    control.broadcast(("stop",))


def _follow(conn: Connection, control: ControlGroup, compiled) -> None:
    """Another rank: run what rank 0 broadcasts; a failure is reported to the front end, and the
    process exits (so rank 0's collectives fail instead of waiting)."""
    programs = {"target": (compiled.program, compiled.graphs)}
    if compiled.draft is not None:
        programs["draft"] = compiled.draft
    try:
        follow(control, programs)
    except BaseException as err:
        conn.send({"ok": False, "error": error_record(err), "traceback": traceback.format_exc()})
        os._exit(1)


def _connect(front_end: tuple[str, int], authkey: bytes, timeout_s: float) -> Connection:
    """The front end's connection; retried while it is not listening yet (a headless node can start
    before the head)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(front_end, authkey=authkey)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def rank_placement(config: EngineConfig, local_rank: int, probe: DeviceProbe | None = None) -> RankPlacement:
    """The rank's device (made current) and its process group's backend, from the device kind
    the front end resolved (:mod:`dcpgraph.devices`)."""
    probe = probe or DeviceProbe()
    kind = config.device
    count, why = probe.count(kind)
    if not count:
        raise errors.ConfigError(f"device={kind!r}: this node has no {kind} device ({why})")
    return place_rank(DeviceKind(kind, count), local_rank, probe)


def worker_main(rank: int, world: int, world_address: tuple[str, int], front_end: tuple[str, int], authkey: bytes,
                config: dict, timeout_s: float, local_rank: int = 0) -> None:
    """A rank: connect to the front end, take its device, join the world, compile; then rank 0
    builds the engine and answers calls, the others follow it."""
    torch.set_num_threads(1)
    conn = _connect(front_end, authkey, timeout_s)
    conn.send({"rank": rank, "pid": os.getpid()})
    try:
        import torch.distributed as dist

        engine_config = EngineConfig.from_json(config)
        placement = rank_placement(engine_config, local_rank)
        host, port = world_address
        dist.init_process_group(placement.backend, rank=rank, world_size=world, init_method=f"tcp://{host}:{port}",
                                timeout=datetime.timedelta(seconds=timeout_s))
        if engine_config.expert_group is not None:  # replicas sharing the experts: the EP group spans them
            ep_host, ep_port, ep_size, replica = engine_config.expert_group
            join_expert_group((ep_host, int(ep_port)), replica * world + rank, int(ep_size), timeout_s)
        control = ControlGroup(host)
        compiled = compile_rank(engine_config, executor="distributed")
        if rank == 0:
            programs = {"target": compiled.program, **({"draft": compiled.draft[0]} if compiled.draft else {})}
            engine = engine_for(compiled, driver_executors(control, programs))
    except BaseException as err:
        conn.send({"ok": False, "error": error_record(err), "traceback": traceback.format_exc()})
        return
    conn.send({"ok": True})  # a follower's before its executors exist: rank 0's engine makes them with it
    if rank == 0:
        _drive(conn, engine, control)
    else:
        _follow(conn, control, compiled)


WORKER_PRELOAD = [*FORKSERVER_PRELOAD, __name__]  # what the fork server imports before forking workers


def warm_fork_server() -> None:
    """Start the fork server now, so that its imports (:data:`FORKSERVER_PRELOAD`, seconds) run
    beside this process's own start-up (option and checkpoint checks, the tokenizer) instead of
    delaying the first worker. :func:`start_workers` then finds it running; the preload list is the
    same :data:`WORKER_PRELOAD`."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    if "forkserver" in mp.get_all_start_methods():
        mp.get_context("forkserver").set_forkserver_preload(WORKER_PRELOAD)
        forkserver.ensure_running()


def start_workers(config: EngineConfig, ranks: Sequence[int], *, world_address: tuple[str, int],
                  front_end: tuple[str, int], authkey: bytes, timeout_s: float, start_method: str | None = None):
    """Start one process per rank of ``ranks`` (:func:`worker_main`); returns them, started."""
    import torch.multiprocessing as mp

    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(WORKER_PRELOAD)
    procs = [ctx.Process(target=worker_main, name=f"dcpgraph-worker{rank}", daemon=True,
                         args=(rank, config.world_size, world_address, front_end, authkey,
                               config.to_json(), timeout_s, local_rank))
             for local_rank, rank in enumerate(ranks)]
    for proc in procs:
        proc.start()
    return procs


# -- the front end ------------------------------------------------------------------------------
class ConnectionLostError(ConnectionError):
    """A worker closed its connection or its process died."""


def receive(conn: Connection, *, timeout_s: float | None, alive: Callable[[], bool]) -> Any:
    """The next message on ``conn``, waiting in :data:`POLL_S` slices and calling ``alive()``
    between them, so a worker that died is noticed within about that long instead of never."""
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else float("inf"))
    while not conn.poll(POLL_S):
        if not alive():
            raise ConnectionLostError("a worker process died")
        if time.monotonic() > deadline:
            raise TimeoutError("no reply from a worker in time")
    try:
        return conn.recv()
    except (EOFError, OSError):
        raise ConnectionLostError("a worker closed its connection") from None


class RemoteEngine(EngineClient):
    """The front end's handle on a worker group: calls go to rank 0, where the engine is."""

    def __init__(self, config: EngineConfig, *, host: str = "127.0.0.1", timeout_s: float = 600.0,
                 start_method: str | None = None, layout: NodeLayout | ReplicaPlacement | None = None,
                 abort: threading.Event | None = None):
        layout = layout or NodeLayout()
        self.start_aborted = abort  # set by another replica that failed to start (replicas sharing the experts)
        self.config = config
        self.timeout_s = timeout_s
        self.dead: str | None = None
        self.started = False  # every rank said it is ready (from then on a follower's message means failure)
        self.last_step_rank_seconds: list[float] = []  # rank 0's own time in its last step
        self.last_step_broadcast_seconds = 0.0  # of which broadcasting the step to the other ranks
        world = config.world_size
        authkey = layout.authkey()
        listener = Listener(layout.front_end_address(host), authkey=authkey)
        self.conns: list[Connection | None] = [None] * world
        self.pids: list[int] = [0] * world
        self.procs = []
        try:
            self.procs = start_workers(config, layout.local_ranks(world), world_address=layout.world_address(host),
                                       front_end=listener.address, authkey=authkey, timeout_s=timeout_s,
                                       start_method=start_method)
            self._accept(listener, time.monotonic() + timeout_s)
            for conn in self.conns:
                hello = receive(conn, timeout_s=timeout_s, alive=self._alive)
                if not hello["ok"]:
                    raise_error_record(hello["error"])
            self.started = True
        except (ConnectionLostError, TimeoutError) as err:
            self.close()
            raise WorkerDiedError(f"the worker group failed to start: {err} (exit codes {self.exit_codes()})"
                                  f"{self._reported_errors()}") from None
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()

    def _accept(self, listener: Listener, deadline: float) -> None:
        """Every rank's connection, accepted on a thread (``Listener.accept`` cannot time out) while
        this one watches the processes and the deadline."""
        accepted: queue.Queue = queue.Queue()

        def accept_all() -> None:
            for _ in self.conns:
                try:
                    accepted.put(listener.accept())
                except (OSError, EOFError) as err:  # the listener closed, or a bad handshake
                    accepted.put(err)
                    return

        threading.Thread(target=accept_all, daemon=True, name="dcpgraph-accept").start()
        for _ in self.conns:
            while True:
                try:
                    conn = accepted.get(timeout=POLL_S)
                    break
                except queue.Empty:
                    if not self._alive():
                        raise ConnectionLostError("a worker exited while starting") from None
                    if time.monotonic() > deadline:
                        raise TimeoutError("workers did not connect in time") from None
            if isinstance(conn, BaseException):
                raise ConnectionLostError(f"accepting a worker failed: {conn}")
            first = receive(conn, timeout_s=30, alive=self._alive)
            self.conns[first["rank"]] = conn
            self.pids[first["rank"]] = first["pid"]

    def _alive(self) -> bool:
        """This node's worker processes run, and (once started) no other rank's connection has
        closed or carries a message: a rank only writes there when it fails. The other ranks'
        connections are how the head sees a rank on another node go away."""
        if not all(p.is_alive() for p in self.procs):
            return False
        if self.start_aborted is not None and self.start_aborted.is_set() and not self.started:
            return False
        return not self.started or not any(c is not None and c.poll(0) for c in self.conns[1:])

    def exit_codes(self) -> list[int | None]:
        return [p.exitcode for p in self.procs]

    def _reported_errors(self) -> str:
        """What ranks reported before failing (their unread messages with an error)."""
        found = []
        for rank, conn in enumerate(self.conns):
            try:
                while conn is not None and conn.poll(0):
                    message = conn.recv()
                    if isinstance(message, dict) and "error" in message:
                        found.append(f"rank {rank}: {message['error']['type']}: {message['error']['message']}")
            except (EOFError, OSError):
                continue
        return "; " + "; ".join(found) if found else ""

    def _call(self, message: dict) -> dict:
        """``message`` to rank 0 and its reply; a lost or silent worker kills the group."""
        self._send(message)
        return self._reply(message["op"])

    def _send(self, message: dict) -> None:
        if self.dead:
            raise WorkerDiedError(self.dead)
        try:
            self.conns[0].send(message)
        except OSError as err:
            self._fail(message["op"], err)

    def _reply(self, op: str) -> dict:
        try:
            reply = receive(self.conns[0], timeout_s=self.timeout_s, alive=self._alive)
        except (ConnectionLostError, OSError, TimeoutError) as err:
            self._fail(op, err)
        if "error" in reply:
            if not self._alive():  # a rank went away during the call: rank 0's collectives failed
                self._fail(op, f"a rank is gone; rank 0: {reply['error']['message']}")
            raise_error_record(reply["error"])
        return reply

    def _fail(self, op: str, err) -> None:
        self.dead = (f"worker group failed during {op!r}: {err} (exit codes here {self.exit_codes()})"
                     f"{self._reported_errors()}")
        self.close()
        raise WorkerDiedError(self.dead) from None

    # -- Engine's interface ----------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], max_new_tokens: int, *, params=None, **sampling: Any) -> int:
        if params is not None:  # rank 0 takes the plain keywords of the same request
            sampling = SamplingParams.for_engine(params, **sampling).engine_params()
        return self._call({"op": "add", "prompt": [int(t) for t in prompt], "max_new_tokens": max_new_tokens,
                           "sampling": sampling})["rid"]

    def step(self) -> list[StepEvent]:
        """Rank 0's events: the one scheduler's step, run on every rank."""
        self.begin_step()
        return self.end_step()

    def begin_step(self) -> None:
        """Start a step without waiting for it (several groups step at once: data parallelism)."""
        self._send({"op": "step"})

    def step_done(self) -> bool:
        """Whether the reply to the step :meth:`begin_step` started has arrived (no waiting)."""
        conn = self.conns[0]
        return conn is not None and conn.poll(0)

    def end_step(self) -> list[StepEvent]:
        """The events of the step :meth:`begin_step` started."""
        reply = self._reply("step")
        self.last_step_rank_seconds = [float(reply["seconds"])]
        self.last_step_broadcast_seconds = float(reply["broadcast_seconds"])
        return [StepEvent(r, t, f, lp, plp) for r, t, f, lp, plp in reply["events"]]

    def abort(self, request_id: int) -> bool:
        return self._call({"op": "abort", "rid": int(request_id)})["aborted"]

    def enable_structured_outputs(self, backend) -> None:
        """Rank 0 builds its own grammar backend from the serialized tokenizer information."""
        text = backend if isinstance(backend, str) else backend.serialize()
        self._call({"op": "structured_outputs", "backend": text})

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, **sampling: Any) -> list[list[int]]:
        """:meth:`Engine.generate <dcpgraph.runtime.engine.Engine.generate>` on rank 0's engine."""
        return self._call({"op": "generate", "prompts": [[int(t) for t in p] for p in prompts],
                           "max_new_tokens": max_new_tokens, "sampling": sampling})["value"]

    def memory_report(self) -> dict:
        return self._call({"op": "memory_report"})["value"]

    def report(self) -> dict:
        return self._call({"op": "report"})["value"]

    def rank_call(self, name: str, args: dict) -> list:
        """A rank op (:mod:`dcpgraph.runtime.engine_client`): its driver half on rank 0, its rank
        half (if any) on every rank; one value, or one per rank."""
        return self._call({"op": "rank_call", "name": name, "args": args})["value"]

    def healthy(self) -> bool:
        return not self.dead and self._alive()

    def worker_pids(self) -> list[int]:
        return list(self.pids)

    def kv_usage_per_rank(self) -> list[tuple[int, int]]:
        return [tuple(u) for u in self._call({"op": "kv_usage"})["value"]]

    def close(self) -> None:
        """Ask rank 0 to stop the group, then make sure: join briefly, kill what is left."""
        driver = self.conns[0]
        if driver is not None and not self.dead:
            try:
                driver.send({"op": "shutdown"})
                receive(driver, timeout_s=5, alive=self._alive)
            except (ConnectionLostError, OSError, TimeoutError):
                pass
        for conn in self.conns:
            if conn is not None:
                conn.close()
        self.conns = [None] * len(self.conns)
        self.dead = self.dead or "the worker group was shut down"
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
