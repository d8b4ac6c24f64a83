"""``dcpgraph.plan``: a deployment planner that predicts memory, KV capacity and decode cost for
every valid (tp, dcp, interleave, comm) of a model on given hardware, and recommends one.

    from dcpgraph.plan import plan, render_table
    p = plan("kimi-k2", world_size=8, hardware="h200", kv_cache_memory_bytes=50_249_539_584,
             block_size=64, max_model_len=131072, context_len=32768, concurrency=64)
    print(render_table(p))

Capacity uses :mod:`dcpgraph.capacity` (the per-block byte formula of the compiled program) and
:meth:`dcpgraph.Mesh.validate`; cost uses :mod:`.cost`; hardware presets are in :mod:`.hardware`.
"""

from .architectures import ARCHITECTURES
from .calibration import (
    AttentionCalibration,
    calibrate_attention,
    get_hardware,
    measure_links,
    measure_this_machine,
)
from .cost import Collective, StepCost, dcp_collectives, decode_step
from .hardware import HARDWARE_NAMES, PRESETS, Hardware
from .model_shape import KV_CACHE_DTYPES, ModelShape, load_model_shape
from .planner import Plan, PlanRow, plan
from .render import plan_dict, render_json, render_table

__all__ = [
    "ARCHITECTURES", "AttentionCalibration", "HARDWARE_NAMES", "KV_CACHE_DTYPES", "PRESETS", "Collective", "Hardware", "ModelShape",
    "Plan", "PlanRow", "StepCost", "calibrate_attention", "dcp_collectives", "decode_step", "get_hardware",
    "load_model_shape", "measure_links", "measure_this_machine", "plan", "plan_dict", "render_json", "render_table",
]
