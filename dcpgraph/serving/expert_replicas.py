"""Data-parallel replicas that share the routed experts (DP attention + EP): checked and started.

``data_parallel_size=D`` with ``enable_expert_parallel``: every replica is a worker group of ``tp``
ranks with its own scheduler, KV cache and world (TP and DCP groups), and all ``D·tp`` ranks
also join one EP group (:func:`~dcpgraph.runtime.distributed.join_expert_group`), over which each
MoE layer dispatches and combines tokens (:mod:`dcpgraph.passes.experts_over_replicas`). Replica
``d`` compiles with ``expert_replicas=(D, d)``: the same graph, its own slice of the experts.

Refused before any process starts, each by a ``ConfigError`` naming what is valid: a model
without routed experts; ``D·tp`` not dividing the routed experts; speculative decoding (its
draft forwards would not be matched across replicas); ranks on an accelerator (the EP group is a
gloo group of host ranks so far).
"""

from __future__ import annotations

import threading
from dataclasses import replace

from ..errors import ConfigError
from ..passes.experts_over_replicas import check_experts_divide
from .engine_config import EngineConfig
from .nodes import NodeLayout
from .workers import RemoteEngine

EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def routed_experts(hf_config) -> int | None:
    """The routed-expert count of an HF config (its text config for a multimodal one), else None."""
    text = getattr(hf_config, "text_config", None) or hf_config
    for key in EXPERT_COUNT_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_expert_replicas(hf_config, *, tp: int, replicas: int, speculative: bool, device: str = "cpu") -> None:
    """Every refusal of DP attention + EP that the model's config and the deployment decide."""
    if device != "cpu":
        raise ConfigError(f"data_parallel_size={replicas} with enable_expert_parallel on device={device!r}: the EP "
                          "group that spans the replicas is built on gloo for host ranks only so far; use "
                          "device='cpu', or drop enable_expert_parallel (each replica then slices every expert)")
    experts = routed_experts(hf_config)
    if experts is None:
        raise ConfigError(f"data_parallel_size={replicas} with enable_expert_parallel: the model has no routed "
                          "experts to partition; use enable_expert_parallel=False")
    check_experts_divide(experts, tp, replicas)
    if speculative:
        raise ConfigError(f"data_parallel_size={replicas} with enable_expert_parallel runs every replica's forwards "
                          "in lockstep; speculative decoding's draft forwards are not matched across replicas "
                          "yet: drop speculative_config or enable_expert_parallel")


def replica_configs(config: EngineConfig, count: int, host: str, port: int) -> list[EngineConfig]:
    """Replica ``d``'s engine record: compile options ``expert_replicas=(count, d)`` and the EP
    group's store ``host:port``."""
    size = count * config.tensor_parallel_size
    return [replace(config, engine_options={**config.engine_options, "expert_replicas": [count, d]},
                    expert_group=[host, port, size, d]) for d in range(count)]


def start_expert_replicas(config: EngineConfig, count: int, *, host: str, timeout_s: float,
                          nodes: NodeLayout | None = None) -> list[RemoteEngine]:
    """``count`` worker groups started at once (their ranks meet in the EP group while starting);
    if one fails, the others are stopped at once rather than left waiting for it. Across ``nodes``,
    each replica runs whole on its node and the EP group meets at the head (:mod:`.nodes`)."""
    nodes = nodes or NodeLayout()
    configs = replica_configs(config, count, *nodes.expert_group_address(host))
    placements = nodes.replica_placements(count)
    abort, lock = threading.Event(), threading.Lock()
    started: list[RemoteEngine | None] = [None] * count
    errors: list[BaseException] = []  # in the order they happened: the first is the cause

    def start(d: int) -> None:
        try:
            started[d] = RemoteEngine(configs[d], host=host, timeout_s=timeout_s, abort=abort, layout=placements[d])
        except BaseException as err:  # noqa: BLE001 - re-raised below
            with lock:
                errors.append(err)
            abort.set()

    threads = [threading.Thread(target=start, args=(d,), name=f"dcpgraph-replica{d}", daemon=True)
               for d in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for replica in started:
            if replica is not None:
                replica.close()
        raise errors[0]
    return [r for r in started if r is not None]
