"""Rank 0 drives, the other ranks follow (:mod:`dcpgraph.runtime.step_broadcast`), on real gloo ranks.

One spawn of two ranks (~15 s). Both compile the Llama model of ``test_e2e_gqa`` at tp=2, dcp=2.
Rank 1 first follows with a program lowered another way (``comm="ag_rs"`` instead of rank 0's
``"a2a"``: other collectives, other code): rank 0's engine build is refused naming rank 1 before
any rank allocates a cache or joins a group. Rank 0 stops it, rank 1 follows with the same program
as rank 0, and rank 0 builds the one engine and generates. The tokens must equal the in-process
emulated engine's; rank 0 made one scheduler and rank 1 none; a rank op's rank half ran on both.
"""

from __future__ import annotations

import pytest
from gqa_models import BLOCK_SIZE, PROMPTS, build_model

from dcpgraph.runtime.distributed import spawn

pytestmark = pytest.mark.gloo
MAX_NEW = 8


def _rank(rank: int, world: int):
    import dcpgraph
    from dcpgraph.api import compile_programs, engine_for
    from dcpgraph.runtime.scheduler import Scheduler
    from dcpgraph.runtime.step_broadcast import ControlGroup, driver_executors, follow

    control = ControlGroup()
    model = build_model("llama")
    options = dict(tp=world, dcp=2, block_size=BLOCK_SIZE, num_blocks=32, executor="distributed")
    right = compile_programs(model, comm="a2a", **options)
    created = Scheduler.created
    if rank == 0:
        with pytest.raises(dcpgraph.ConfigError, match="rank 1: compiled a different target program"):
            engine_for(right, driver_executors(control, {"target": right.program}))
        control.broadcast(("stop",))
        created = Scheduler.created  # the refused build made one before its executor was refused
        engine = engine_for(right, driver_executors(control, {"target": right.program}))
        tokens = engine.generate([list(p) for p in PROMPTS], MAX_NEW)
        ranks = engine.rank_call("process.report", {})
        control.broadcast(("stop",))
        return {"tokens": tokens, "ranks": ranks, "schedulers": Scheduler.created - created,
                "executor": engine.report()["executor"]}
    wrong = compile_programs(model, comm="ag_rs", **options)
    follow(control, {"target": (wrong.program, wrong.graphs)})  # until rank 0's stop after the refusal
    follow(control, {"target": (right.program, right.graphs)})
    return {"schedulers": Scheduler.created - created}


def test_driver_schedules_and_a_follower_with_another_program_is_refused():
    results = spawn(_rank, 2, timeout_s=240)
    expected = __import__("dcpgraph").compile(build_model("llama"), tp=2, dcp=2, block_size=BLOCK_SIZE,
                                               num_blocks=32, comm="a2a").generate([list(p) for p in PROMPTS], MAX_NEW)
    assert results[0]["tokens"] == expected
    assert results[0]["schedulers"] == 1 and results[1]["schedulers"] == 0
    assert [r["rank"] for r in results[0]["ranks"]] == [0, 1] and results[0]["executor"] == "driver"


def test_a_packed_step_round_trips_every_tensor_exactly():
    import pickle

    import torch

    from dcpgraph.runtime.step_broadcast import pack

    base = torch.arange(40, dtype=torch.int32).reshape(5, 8)
    message = ("run", 1, ("decode", 8), {"view": base[1:3, ::2], "bf16": torch.randn(3, 4, dtype=torch.bfloat16),
                                         "empty": torch.empty(0, 5), "scalar": torch.tensor(7), "flag": True},
               [{"fp8": torch.randn(4).to(torch.float8_e4m3fn)}])
    back = pickle.loads(pack(message))
    assert back[:3] == message[:3] and back[3]["flag"] is True
    for got, want in [*((back[3][k], message[3][k]) for k in ("view", "bf16", "empty", "scalar")),
                      (back[4][0]["fp8"], message[4][0]["fp8"])]:
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8))
    assert len(pack(message)) < 1000  # the view's 4 elements, not its base's 40
