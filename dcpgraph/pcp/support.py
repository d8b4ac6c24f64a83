"""What runs with ``pcp > 1``: the mesh is validated everywhere; the compiled engine refuses it.

The compiled engine (``dcpgraph.compile``, ``LLM``, ``dcpgraph serve``) runs ``pcp = 1`` only: its
prefill programs do not yet take a rank's token subset nor exchange K/V over the PCP group. PCP
prefill and the DCP decode after it run eagerly in :mod:`dcpgraph.pcp.eager` (Llama/Qwen3 GQA, any
valid mesh).
"""

from __future__ import annotations

from ..errors import ConfigError
from ..mesh import Mesh


def refuse_pcp_execution(mesh: Mesh) -> None:
    """Raise :class:`ConfigError` for ``pcp > 1``, naming what is supported, before any work starts."""
    if mesh.pcp == 1:
        return
    raise ConfigError(
        f"prefill_context_parallel_size={mesh.pcp} (tp={mesh.tp}, dcp={mesh.dcp}) is a valid mesh, but the "
        "compiled engine (compile, LLM, serve) runs prefill_context_parallel_size=1 only: its prefill programs "
        "do not split tokens over PCP ranks yet (so speculative decoding, P/D and graph mode with pcp > 1 are "
        "refused too). The PCP prefill and the DCP decode after it run eagerly for GQA models (Llama, Qwen3) "
        "in dcpgraph.pcp.eager (see docs/user-guide/pcp.md); use pcp=1 here"
    )
