"""The exceptions dcpgraph raises on purpose.

Every one of them is raised *before* any collective starts, so no rank is left waiting on a peer
that already gave up.
"""


class DcpGraphError(Exception):
    """Base class of the errors dcpgraph raises deliberately."""


class ConfigError(DcpGraphError, ValueError):
    """A parallel configuration (tp, dcp, interleave, block size…) that cannot work for a model.

    The message names the rule that failed and the nearest settings that satisfy it.
    """


class UnsupportedModelError(DcpGraphError, NotImplementedError):
    """A model, or a feature of one of its layers, that the pipeline does not implement.

    Raised instead of silently rewriting the model into something that computes a different
    function (ALiBi, explicit mask tensors, packed varlen inputs, non-causal attention…).
    """


class VerificationError(DcpGraphError, AssertionError):
    """A pass produced a program that breaks an invariant; the message names pass and invariant.

    Where the invariant fails at one node, the message ends with the program lines around it,
    the failing line marked ``>>``.
    """


class PassOrderError(VerificationError):
    """A pass was asked to run on a Program that lacks what it ``requires`` (a misordered
    pipeline); the message names the pass, the requirement (often another pass) and the stages
    run so far."""


class RequestError(DcpGraphError, ValueError):
    """A generation request that can never be served (empty prompt, token id outside the
    vocabulary, longer than ``max_model_len`` or than the whole KV cache)."""


class GrammarError(RequestError):
    """A request's structured-output constraint cannot be compiled (a bad JSON schema, regex or
    EBNF grammar); the message carries the compiler's reason."""


class QueueFullError(RequestError):
    """The waiting queue holds ``max_waiting`` requests: try again later (a server's 429/503).
    Defined here so a worker's refusal keeps its class across the worker connection."""


class CollectiveMismatchError(DcpGraphError, RuntimeError):
    """Ranks of one group reached different collectives: on real hardware this would hang."""


class KVTransferError(DcpGraphError, RuntimeError):
    """A prefill/decode KV transfer failed or timed out (the peer instance died, never joined,
    or the transfer exceeded its timeout); the request's blocks were freed on this side."""

    http_status = 503
