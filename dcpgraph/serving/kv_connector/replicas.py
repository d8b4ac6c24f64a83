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
"""

from __future__ import annotations

from ...errors import ConfigError
from .agent import KVAgent
from .config import KVTransferConfig

COUNTERS = ("transfers_sent", "transfers_received", "bytes_sent", "bytes_received", "tokens_sent", "tokens_received",
            "tokens_from_prefix_cache", "failures", "expired", "held")


def check_data_parallel_pd(config: KVTransferConfig, replicas: int, *, expert_parallel: bool = False) -> None:
    """Raise ``ConfigError`` for a P/D setting ``replicas`` data-parallel replicas cannot run, naming
    what runs: every replica needs a rendezvous port (``kv_port + replicas - 1 <= 65535``); replicas
    that produce hold their transfers on stores only the ``kv_rank 0`` instance hosts, so a
    producer (or ``kv_both``) with ``replicas > 1`` must be ``kv_rank 0``; replicas sharing the
    routed experts (``enable_expert_parallel``) are not run as P/D instances."""
    if replicas == 1:
        return
    if expert_parallel:
        raise ConfigError(f"--kv-transfer-config with --data-parallel-size {replicas} and --enable-expert-parallel "
                          "is not supported (replicas that share the routed experts step together); P/D runs with "
                          "-dp without --enable-expert-parallel, or with --enable-expert-parallel at -dp 1")
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
        check_data_parallel_pd(config, len(engine.replicas), expert_parallel=engine.lockstep)
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
        """The counters summed over replicas, each replica's own under ``replicas``; ``last_*``
        from the highest replica that has one."""
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
