"""Errors raised by attnres_fx. Every one derives from :class:`AttnResError`."""

from __future__ import annotations

from .compat import DynamoUnsupported, assume_constant_result, tracing_for_one_graph


class AttnResError(Exception):
    """Base class of every error attnres_fx raises on purpose."""


class TraceError(AttnResError):
    """The model could not be turned into a graph by the requested tracer(s).

    ``causes`` maps each tracer that was tried to the exception it raised.
    """

    def __init__(self, message: str, causes: dict[str, BaseException] | None = None):
        super().__init__(message)
        self.causes = dict(causes or {})


class NoResidualStreamError(AttnResError):
    """Tracing worked, but no residual stream was found in the graph.

    ``rejected`` lists ``(node name, owning module, reason)`` for every add that was considered.
    """

    def __init__(self, message: str, rejected: list[tuple[str, str, str]] | None = None):
        super().__init__(message)
        self.rejected = list(rejected or [])


class UnsupportedArchitectureError(AttnResError):
    """The graph has residual connections, but of a form Block AttnRes does not apply to."""


class RoutingError(AttnResError):
    """A converted model was asked for something its routing cannot do: converting it again, converting
    a model whose ``forward`` another library replaced, ``torch.export`` of it (use
    :func:`attnres_fx.rewrite`), or module hooks on its aggregations under the Inductor route."""


class ForeignCompileError(RoutingError, DynamoUnsupported):
    """``torch.compile(..., fullgraph=True)`` of a converted model or of one of its routed blocks: the
    AttnRes rewrite runs on attnres_fx's own graphs, so it cannot be part of another compilation's single
    graph. (A TorchDynamo ``Unsupported`` too, so Dynamo reports it as it is.)"""

    def __init__(self, message: str):
        DynamoUnsupported.__init__(self, message)


class PassContractError(AttnResError):
    """A pass was given inputs that do not belong together (a detection of another graph, a plan for
    other streams), or left a graph that breaks what it ensures."""


class StreamMismatchError(AttnResError):
    """A graph captured for a call of a converted model holds a residual stream that is not the one the
    model was converted with (or none at all): the message names the sites that differ."""


class CheckpointMismatchError(AttnResError):
    """A saved converted model does not fit: no or another ``attnres_config.json``, other sites, or
    missing AttnRes weights; the message names what differs."""


class WriteError(AttnResError, OSError):
    """Writing a file or folder failed (the disk full, a folder not writable, an interrupted move); the
    target is as it was before. The message names the target, the step and the cause; ``errno`` is the
    underlying error's."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.errno = code


class ExportError(AttnResError):
    """Compiling or exporting a rewritten module failed; carries the exporter's root cause."""


class ServingLayoutError(ExportError):
    """The model does not fit the folder a serving runtime loads (onnxruntime-genai's decoder-only
    layout: one decoder graph whose cache is keys and values per attention layer): an encoder-decoder, a
    state-space or linear-attention cache, a model that does not generate text. Raised before anything
    is written; the message names what does not fit."""


class DepthWeightsError(AttnResError):
    """Depth weights could not be recorded: a site did not run as a module during the recorded calls, or
    its calls' per-token weights do not fit together."""


class AttnResWarning(UserWarning):
    """The rewrite went ahead, but the result may not behave as the user expects."""


@assume_constant_result
def refuse_fullgraph_trace(message: str) -> bool:
    """Raise :class:`ForeignCompileError` with ``message`` while TorchDynamo traces this call for one graph;
    return True otherwise. ``assume_constant_result`` runs the function during tracing, where the trace
    says whether graph breaks are allowed (:func:`attnres_fx.compat.tracing_for_one_graph`); the error is
    a Dynamo ``Unsupported`` too, so Dynamo reports it as it is."""
    if tracing_for_one_graph():
        raise ForeignCompileError(message)
    return True
