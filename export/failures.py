"""Turn a failure deep inside torch.compile, torch.export, the ONNX exporter or onnxruntime into an
:class:`~attnres_fx.ExportError` that states the root cause and what to do about it.

The exporters wrap the real problem in several layers (``ConversionError`` -> ``TorchExportError`` ->
``GuardOnDataDependentSymNode``) whose outer messages are mostly boilerplate; the innermost exception
of the ``__cause__`` / ``__context__`` chain is the one that names the problem.
"""

from __future__ import annotations

from contextlib import contextmanager

from attnres_fx.diagnostics import chain, describe, user_frame
from attnres_fx.errors import ExportError

# (substrings looked for in the type names and messages of the whole chain, hint). First match wins.
_HINTS = (
    (("No space left on device", "Disk quota exceeded", "os error 28"),
     "the disk is full: free space and export again (the target was left as it was)."),
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
    (("complex-valued input",),
     "forward() computes with complex tensors (rotary embeddings as a complex product, as Llama 4's), which "
     "the ONNX exporter translates at no opset; the unconverted model fails the same way. Compute the "
     "rotation with real tensors (cos/sin), or run the model in PyTorch (eager or attnres_fx.compile)."),
    (("DispatchError", "No ONNX function found", "not supported by the ONNX"),
     "an operator has no ONNX translation at this opset: try a newer opset=..., or replace the operator."),
)
_DEFAULT_HINT = "the exporter's full traceback is this error's __cause__."


def hint(err: BaseException) -> str:
    texts = [f"{type(e).__module__}.{type(e).__qualname__}: {e}" for e in chain(err)]
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
