"""Data parallelism: ``D`` replicas of the deployment behind one client, :class:`DataParallelEngine`.

Each replica is a worker group of ``tp`` ranks with its own scheduler, KV cache and gloo world
(:class:`~.workers.RemoteEngine`); the front end holds all of them as one
:class:`~dcpgraph.runtime.engine_client.EngineClient`. Invariants:

- a request lives on one replica for its whole life; it goes where :class:`~.prefix_routing.PrefixAwareRouter`
  says: the replica with the fewest live requests (ties: the lowest index), vLLM's least-outstanding
  balancing, unless another replica holds a longer prefix of the prompt and is at most
  ``balance_slack`` requests busier;
- request ids are the client's own (``0, 1, ...``), mapped to each replica's ids, so events and
  aborts never mix replicas;
- a step starts on every replica that has live requests before waiting for any, so replicas run
  their steps at the same time; its events are the replicas' events in replica order;
- the group is healthy only while every replica is (one lost replica fails ``/health``).

Each replica is one engine of the metrics (the ``engine`` label, ``"0"`` to ``"D-1"``):
:meth:`engine_of` and :meth:`engine_states` give the serving layer what to label.

With ``lockstep`` (replicas sharing the routed experts, :mod:`.expert_replicas`), every MoE
layer is a collective over all replicas' ranks, so a step starts on *every* replica whenever one
has work (an idle one runs a dummy forward, :meth:`~dcpgraph.runtime.model_runner.ModelRunner.dummy_forward`)
and a replica that fails stops the whole group at once (:meth:`_await_steps`).

P/D transfer runs one KV agent per replica (:mod:`.kv_connector.replicas`): a producer's held
request leaves this client (:meth:`detach`), a consumer's adopted one joins it on the replica the
router chose (:meth:`route`, then :meth:`attach`). With ``lockstep`` too: every transfer call is made
between two steps of this client, never inside one (why the EP collectives stay in order:
:mod:`.kv_connector.replicas`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError, QueueFullError, RequestError
from ..runtime.engine_client import WAITING_IDS, EngineClient
from ..runtime.sampling_params import SamplingParams
from ..runtime.scheduler import StepEvent
from .prefix_routing import PrefixAwareRouter
from .workers import POLL_S, WorkerDiedError

MERGED_OPS = {WAITING_IDS, "process.report", "reset_prefix_cache"}


class DataParallelEngine(EngineClient):
    def __init__(self, replicas: Sequence[EngineClient], *, lockstep: bool = False,
                 router: PrefixAwareRouter | None = None):
        self.replicas = list(replicas)
        self.router = router if router is not None else PrefixAwareRouter(len(self.replicas))
        self.lockstep = lockstep  # replicas share the routed experts: every replica steps whenever one does
        self._owner: dict[int, tuple[int, int]] = {}  # client id -> (replica, replica's id)
        self._ids: list[dict[int, int]] = [{} for _ in self.replicas]  # per replica: its id -> client id
        self.requests_served = [0] * len(self.replicas)
        self._next_id = 0

    def live(self, replica: int) -> int:
        return len(self._ids[replica])

    def add_request(self, prompt: Sequence[int], max_new_tokens: int, **sampling: Any) -> int:
        replica = self.route(prompt)
        return self.attach(replica, self.replicas[replica].add_request(prompt, max_new_tokens, **sampling))

    def route(self, prompt: Sequence[int]) -> int:
        """The replica a new request for ``prompt`` goes to (recorded by the router)."""
        return self.router.choose(prompt, [self.live(i) for i in range(len(self.replicas))])

    def attach(self, replica: int, local: int) -> int:
        """Take request ``local`` of ``replica`` (added there directly, e.g. adopted from a P/D
        transfer) as one of this client's; returns its client id."""
        rid, self._next_id = self._next_id, self._next_id + 1
        self._owner[rid] = (replica, local)
        self._ids[replica][local] = rid
        self.requests_served[replica] += 1
        return rid

    def detach(self, request_id: int) -> tuple[int, int]:
        """Stop tracking ``request_id`` without aborting it (a producer holds its KV for a transfer);
        returns ``(replica, the replica's id)``."""
        replica, local = self._owner[request_id]
        self._forget(replica, local)
        return replica, local

    def enable_structured_outputs(self, backend) -> None:
        for replica in self.replicas:
            replica.enable_structured_outputs(backend)

    def _forget(self, replica: int, local: int) -> None:
        rid = self._ids[replica].pop(local, None)
        self._owner.pop(rid, None)

    def step(self) -> list[StepEvent]:
        busy = [i for i in range(len(self.replicas)) if self.live(i)]
        if self.lockstep and busy:
            busy = list(range(len(self.replicas)))  # an idle replica runs a dummy forward
        for i in busy:
            self.replicas[i].begin_step()
        if self.lockstep:
            self._await_steps(busy)
        events = []
        for i in busy:
            for event in self.replicas[i].end_step():
                rid = self._ids[i][event[0]]
                if event[2]:
                    self._forget(i, event[0])
                events.append(StepEvent(rid, event[1], event[2], event.logprobs, event.prompt_logprobs))
        return events

    def _await_steps(self, stepping: list[int]) -> None:
        """Wait until every stepping replica has answered. Replicas in lockstep wait for each
        other inside every MoE layer, so one that fails leaves the others blocked: the whole group
        is stopped as soon as any replica is seen unhealthy (within a poll interval), instead of
        waiting on a replica that can never answer."""
        pending = list(stepping)
        while pending:
            for i in list(pending):
                replica = self.replicas[i]
                if replica.step_done():
                    pending.remove(i)
                elif not replica.healthy():
                    self.close()
                    raise WorkerDiedError(f"data-parallel replica {i} failed during a lockstep step "
                                          f"(replicas share the experts, so all {len(self.replicas)} were stopped)")
            if pending:
                time.sleep(POLL_S / 10)

    def abort(self, request_id: int) -> bool:
        if request_id not in self._owner:
            return False
        replica, local = self._owner[request_id]
        self._forget(replica, local)
        return self.replicas[replica].abort(local)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, params=None,
                 **sampling: Any) -> list[list[int]]:
        """Every prompt to completion over the replicas (each request on one of them); a seeded
        prompt ``i`` samples with ``seed + i``, as :meth:`Engine.generate` does."""
        if self._owner:
            raise RequestError(f"generate() needs an idle engine: {len(self._owner)} request(s) are live")
        base = SamplingParams.for_engine(params, **sampling).engine_params()
        outputs: dict[int, list[int]] = {}
        order = []
        for i, prompt in enumerate(prompts):
            seeded = {**base, "seed": base["seed"] + i} if base.get("seed") is not None else base
            while True:
                try:
                    rid = self.add_request(prompt, max_new_tokens, **seeded)
                    break
                except QueueFullError:
                    self._collect(outputs)
                except RequestError as err:
                    for live in list(self._owner):
                        self.abort(live)
                    raise RequestError(f"prompt {i}: {err}") from None
            order.append(rid)
            outputs[rid] = []
        while self._owner:
            self._collect(outputs)
        return [outputs[rid] for rid in order]

    def _collect(self, outputs: dict[int, list[int]]) -> None:
        for rid, token, _ in self.step():
            outputs[rid].append(token)

    # -- reports and the rest --------------------------------------------------------------------
    def memory_report(self) -> dict:
        """Replica 0's report (every replica is built alike), and each replica's under ``replicas``."""
        reports = [r.memory_report() for r in self.replicas]
        return {**reports[0], "data_parallel_size": len(reports), "replicas": reports}

    def report(self) -> dict:
        reports = [r.report() for r in self.replicas]
        return {**reports[0], "data_parallel": {"size": len(reports), "requests_served": list(self.requests_served),
                                                "live": [self.live(i) for i in range(len(reports))],
                                                "prefix_routed": self.router.prefix_routed},
                "replicas": reports}

    def rank_call(self, name: str, args: dict) -> list:
        """Ops that ask every replica (waiting ids, in client ids; each rank's process report;
        resetting every prefix cache) run on all of them; any other op (the P/D transfer's) is
        refused: it belongs to one engine (P/D calls each replica's own, through its KV agent)."""
        if name not in MERGED_OPS:
            raise ConfigError(f"rank op {name!r} needs one engine; with --data-parallel-size "
                              f"{len(self.replicas)} there are several: call one replica's (data-parallel P/D "
                              "runs one KV agent per replica)")
        values = [r.rank_call(name, args) for r in self.replicas]
        if name == WAITING_IDS:
            return [[self._ids[i][local] for i, v in enumerate(values) for local in v[0] if local in self._ids[i]]]
        if name == "reset_prefix_cache":
            return [sum(v[0] for v in values)]
        return [item for v in values for item in v]

    def kv_usage_per_rank(self) -> list[tuple[int, int]]:
        return [u for r in self.replicas for u in r.kv_usage_per_rank()]

    @property
    def engine_count(self) -> int:
        return len(self.replicas)

    def engine_of(self, request_id: int) -> int:
        return self._owner[request_id][0]

    def engine_states(self) -> list[tuple[list[tuple[int, int]], dict]]:
        return [(r.kv_usage_per_rank(), r.report()) for r in self.replicas]

    def healthy(self) -> bool:
        return all(r.healthy() for r in self.replicas)

    def worker_pids(self) -> list[int]:
        return [pid for r in self.replicas for pid in r.worker_pids()]

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()
