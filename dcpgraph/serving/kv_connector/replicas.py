"""``ReplicaKVAgents``: P/D for a data-parallel instance (``-dp D``), one :class:`~.agent.KVAgent`
per replica behind the front end's one engine thread.

Invariants:

- replica ``r``'s agent drives only replica ``r``'s ranks and rendezvouses at ``kv_port + r``
  (:meth:`~.config.KVTransferConfig.for_replica`); with ``kv_rank == 0`` each agent hosts its own store;
- producer: a request is held by the agent of the replica that prefilled it, and leaves the
  front end's client (:meth:`~dcpgraph.serving.data_parallel.DataParallelEngine.detach`); the
  returned parameters name that replica (``kv_replica``);
- consumer: a transferred request goes to the replica the front end's router chooses for its prompt
  (prefix-cache aware, then least outstanding), which pulls from the endpoint the parameters name,
  and joins the client there once received (:meth:`~dcpgraph.serving.data_parallel.DataParallelEngine.attach`);
- what the transfer cannot run is refused by :func:`check_data_parallel_pd` before any process starts.

Replicas that share the routed experts (``--enable-expert-parallel``, a ``lockstep``
:class:`~dcpgraph.serving.data_parallel.DataParallelEngine`) make every MoE layer a collective
over all replicas' ranks (the EP group), so every rank must enter the same EP collectives in the
same order. Transfers keep that order because:

1. EP collectives are made only inside a forward (one MAX all-reduce of the token count, then an
   all-gather and a reduce-scatter per MoE layer), and every forward belongs to a step;
2. a lockstep step starts on every replica or on none, and is one forward on each: its batch, or a
   dummy forward of one token when it has nothing scheduled (a producer replica whose requests are
   all held for transfer, since a held request has left its scheduler);
3. every transfer call (``side``, ``hold``, ``release``, ``adopt``, ``send``, ``recv``) is a rank op
   that the front end's one engine thread makes on one replica *between* two steps, never while
   one is in flight, and its rank halves move KV over the transfer's own gloo group (rendezvous at
   ``kv_port + r``), never over the EP group.

So the ``k``-th forward of every rank of every replica is the same lockstep step, whatever the
transfers in between; a transfer on replica ``r`` only delays the next step of all of them (as it
pauses an instance's other requests without replicas). A consumer's adopted request is in its
replica's scheduler from ``adopt`` and joins the client (``attach``) before the next step, so it
is stepped like any other.
"""

from __future__ import annotations

from ...errors import ConfigError
from .agent import COUNTERS, KVAgent
from .config import KVTransferConfig


def check_data_parallel_pd(config: KVTransferConfig, replicas: int) -> None:
    """Raise ``ConfigError`` for a P/D setting ``replicas`` data-parallel replicas cannot run, naming
    what runs: every replica needs a rendezvous port (``kv_port + replicas - 1 <= 65535``); replicas
    that produce hold their transfers on stores only the ``kv_rank 0`` instance hosts, so a
    producer (or ``kv_both``) with ``replicas > 1`` must be ``kv_rank 0``. Replicas that share the
    routed experts run as any others (the module's docstring says why their EP collectives stay
    in order)."""
    if replicas == 1:
        return
    config.replica_port(replicas - 1)
    if config.is_producer and not config.hosts_store:
        raise ConfigError(f"--kv-transfer-config: a {config.kv_role} with --data-parallel-size {replicas} must be "
                          f"kv_rank 0, got kv_rank {config.kv_rank}: its replica r holds transfers at kv_port + r "
                          f"({config.kv_port}..{config.kv_port + replicas - 1}), stores the kv_rank 0 instance hosts "
                          "for its own replicas; make this instance kv_rank 0, or run it at -dp 1")


class ReplicaKVAgents:
    def __init__(self, config: KVTransferConfig, engine, *, agent=KVAgent):
        """``engine``: a :class:`~dcpgraph.serving.data_parallel.DataParallelEngine`; ``agent``
        builds replica ``r``'s agent as ``agent(config, replica_engine, replica=r)``."""
        check_data_parallel_pd(config, len(engine.replicas))
        self.config = config
        self.engine = engine
        self.agents: list = []
        try:
            for r, replica in enumerate(engine.replicas):
                self.agents.append(agent(config, replica, replica=r))
        except BaseException:
            self.close()
            raise

    @property
    def held(self) -> bool:
        return any(a.held for a in self.agents)

    @property
    def stats(self) -> dict:
        """The counters (:data:`~.agent.COUNTERS`) summed over replicas, each replica's own under
        ``replicas``; ``last_*`` from the highest replica that has one."""
        per = [a.stats for a in self.agents]
        total = {"role": self.config.kv_role, "kv_rank": self.config.kv_rank, "data_parallel_size": len(per),
                 **{k: sum(s[k] for s in per) for k in COUNTERS}}
        for key in ("last_transfer_s", "last_error"):
            total[key] = next((s[key] for s in reversed(per) if s[key] is not None), None)
        return {**total, "replicas": per}

    def hold(self, rid: int) -> dict:
        replica, local = self.engine.detach(rid)
        return self.agents[replica].hold(local)

    def tick(self) -> None:
        for agent in self.agents:
            agent.tick()

    def receive(self, prompt_ids: list[int], max_tokens: int, sampling: dict, params: dict) -> tuple[int, list[int]]:
        """:meth:`KVAgent.receive` on the replica the router chooses; returns the client's id."""
        replica = self.engine.route(prompt_ids)
        local, output = self.agents[replica].receive(prompt_ids, max_tokens, sampling, params)
        return self.engine.attach(replica, local), output

    def close(self) -> None:
        for agent in self.agents:
            agent.close()
