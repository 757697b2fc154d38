"""Turn a failure deep inside torch.compile, torch.export, the ONNX exporter or onnxruntime into an
:class:`~attnres_fx.ExportError` that states the root cause and what to do about it.

The exporters wrap the real problem in several layers (``ConversionError`` -> ``TorchExportError`` ->
``GuardOnDataDependentSymNode``) whose outer messages are mostly boilerplate; the innermost exception
of the ``__cause__`` / ``__context__`` chain is the one that names the problem.
"""

from __future__ import annotations

import os
import traceback
from contextlib import contextmanager

import torch

from attnres_fx.errors import ExportError

MAX_CAUSE_LINES = 12

# (substrings looked for in the type names and messages of the whole chain, hint). First match wins.
_HINTS = (
    (("GuardOnDataDependent", "data-dependent", "Data-dependent"),
     "forward() makes a Python decision on tensor values (e.g. `if x.sum() > 0:`), or produces a shape "
     "that depends on them (e.g. `x[x > 0]`), which a graph cannot hold. Express the choice with "
     "torch.where / torch.cond, or make it outside forward()."),
    (("Cannot view a tensor with shape",),
     "a known limit of the ONNX exporter: attention computed with scaled_dot_product_attention followed "
     "by .view() on its transposed output fails to decompose with dynamic shapes (Hugging Face T5 with "
     "attn_implementation='sdpa'). Load the model with attn_implementation='eager' before attnresify()."),
    (("torch._dynamo.exc.Unsupported",),
     "attnres_fx.export.compile uses fullgraph=True, so a graph break is an error. Remove the construct "
     "named above from forward(), or pass fullgraph=False to accept graph breaks."),
    (("DispatchError", "No ONNX function found", "not supported by the ONNX"),
     "an operator has no ONNX translation at this opset: try a newer opset=..., or replace the operator."),
)
_DEFAULT_HINT = "the exporter's full traceback is this error's __cause__."


def _chain(err: BaseException):
    """``err`` and the exceptions it was raised from or during, outermost first."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)


def root_cause(err: BaseException) -> BaseException:
    """The innermost exception of ``err``'s chain."""
    *_, innermost = _chain(err)
    return innermost


def describe(err: BaseException) -> str:
    """``Type: first paragraph of the message`` of the root cause, at most MAX_CAUSE_LINES lines."""
    cause = root_cause(err)
    text = str(cause).strip().split("\n\n")[0]
    lines = text.splitlines() or [repr(cause)]
    if len(lines) > MAX_CAUSE_LINES:
        lines = lines[:MAX_CAUSE_LINES] + ["..."]
    return f"{type(cause).__name__}: " + "\n".join(lines)


def user_frame(err: BaseException) -> str | None:
    """``file:line: code`` of the innermost frame, where the root cause was raised, that is the model's
    own code (neither torch nor this package); ``None`` when no such frame is known."""
    cause = root_cause(err)
    skip = (os.path.dirname(torch.__file__), os.path.dirname(__file__), "<")
    # Dynamo raises from its own frames; the user frames it was tracing are in ``real_stack``.
    frames = [*traceback.extract_tb(cause.__traceback__), *(getattr(cause, "real_stack", None) or [])]
    frames = [f for f in frames if not f.filename.startswith(skip)]
    if not frames:
        return None
    return f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}"


def hint(err: BaseException) -> str:
    texts = [f"{type(e).__module__}.{type(e).__qualname__}: {e}" for e in _chain(err)]
    for needles, advice in _HINTS:
        if any(needle in text for needle in needles for text in texts):
            return advice
    return _DEFAULT_HINT


def export_error(stage: str, err: BaseException) -> ExportError:
    where = user_frame(err)
    location = f"\n  at {where}" if where else ""
    return ExportError(f"{stage} failed: {describe(err)}{location}\nHint: {hint(err)}")


@contextmanager
def reraise_as_export_error(stage: str):
    """Any exception inside becomes an ExportError naming ``stage``; the original stays as __cause__."""
    try:
        yield
    except ExportError:
        raise
    except Exception as err:  # noqa: BLE001 - every exporter failure is reported the same way
        raise export_error(stage, err) from err
