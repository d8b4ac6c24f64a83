"""dcpgraph: decode context parallelism as a compiler over FX graphs."""

from . import layout, ops
from .errors import (
    CollectiveMismatchError,
    ConfigError,
    DcpGraphError,
    PassOrderError,
    RequestError,
    UnsupportedModelError,
    VerificationError,
)
from .mesh import Mesh

__version__ = "0.1.0"

__all__ = [
    "CollectiveMismatchError",
    "ConfigError",
    "DcpGraphError",
    "Mesh",
    "PassOrderError",
    "RequestError",
    "UnsupportedModelError",
    "VerificationError",
    "layout",
    "ops",
]

from . import speculative  # noqa: E402,F401  (registers the draft proposers Engine builds by method)
from .api import compile, trace  # noqa: E402,A004
from .runtime.engine import Engine  # noqa: E402

__all__ += ["Engine", "compile", "trace"]

from .explain import explain  # noqa: E402

__all__ += ["explain"]

from .serving import LLM, SamplingParams  # noqa: E402

__all__ += ["LLM", "SamplingParams"]
