"""onnxruntime sessions on an explicit device, and checking an ONNX model against its torch module."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from attnres_fx.checks import max_abs_diff, relative_error
from attnres_fx.errors import ExportError
from attnres_fx.text import format_table

from .failures import reraise_as_export_error
from .signature import Call, bind, module_device, tensor_outputs

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


def session(path: str | Path, device: str = "auto") -> ort.InferenceSession:
    """An ``onnxruntime.InferenceSession`` for the model at ``path``.

    ``device``: ``"cpu"``; ``"cuda"`` or ``"cuda:<index>"`` (CUDAExecutionProvider, required: raises
    :class:`attnres_fx.ExportError` if onnxruntime fell back to CPU, which it otherwise does silently
    when the CUDA provider or its libraries are missing); ``"auto"``: CUDA when onnxruntime can really
    run it, else CPU.

    The providers actually in use, primary first, are ``session.get_providers()``;
    :class:`VerifyReport` repeats them.
    """
    kind, _, index = device.partition(":")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:<index>', got {device!r}")
    cuda = (CUDA, {"device_id": int(index or 0)})
    if kind == "cpu" or (kind == "auto" and CUDA not in ort.get_available_providers()):
        return _create(path, [CPU])
    sess = _create(path, [cuda, CPU])
    if kind == "cuda" and CUDA not in sess.get_providers():
        raise ExportError(
            f"device={device!r}: onnxruntime fell back to CPU (providers in use: {sess.get_providers()}; "
            f"providers this onnxruntime build offers: {ort.get_available_providers()}).\n"
            "Hint: install onnxruntime-gpu built for this machine's CUDA and cuDNN in place of the CPU "
            "'onnxruntime' package, or use device='cpu' / 'auto'.")
    return sess


def _create(path: str | Path, providers: list) -> ort.InferenceSession:
    with reraise_as_export_error(f"onnxruntime loading {path}"):
        return ort.InferenceSession(str(path), providers=providers)


@dataclass(frozen=True)
class OutputDiff:
    """Agreement of one output: ``max_abs`` and ``max_rel`` as :mod:`attnres_fx.checks` defines them
    (``max_rel`` per row of the last dimension, e.g. per token)."""

    name: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    ok: bool


@dataclass(frozen=True)
class VerifyReport:
    """torch module vs onnxruntime on the same inputs: one :class:`OutputDiff` per graph output.

    ``ok`` when every output has the reference's shape and ``|onnx - torch| <= atol + rtol * |torch|``
    element-wise (``torch.allclose``). ``providers``: the onnxruntime providers in use.
    """

    outputs: tuple[OutputDiff, ...]
    providers: tuple[str, ...]
    atol: float
    rtol: float

    @property
    def ok(self) -> bool:
        return all(out.ok for out in self.outputs)

    @property
    def max_abs(self) -> float:
        return max(out.max_abs for out in self.outputs)

    def raise_if_failed(self) -> VerifyReport:
        if not self.ok:
            raise ExportError(f"onnxruntime disagrees with the torch module:\n{self}")
        return self

    def __str__(self) -> str:
        rows = [(out.name, str(list(out.shape)), f"{out.max_abs:.3e}", f"{out.max_rel:.3e}", "yes" if out.ok else "NO")
                for out in self.outputs]
        return (f"onnxruntime vs torch (providers: {', '.join(self.providers)}; "
                f"atol={self.atol:g}, rtol={self.rtol:g})\n"
                + format_table(("output", "shape", "max |diff|", "relative", "ok"), rows, indent="  "))


def verify(module: nn.Module, path_or_session: str | Path | ort.InferenceSession, example_inputs: Any, *,
           example_kwargs: dict | None = None, atol: float = 1e-4, rtol: float = 1e-4) -> VerifyReport:
    """Run ``module`` and the ONNX model on the same inputs and compare every output.

    A path is opened with :func:`session` on the module's device (``"auto"`` for a CUDA module, so that
    onnxruntime uses CUDA when it can; ``"cpu"`` otherwise). Inputs may have other batch sizes and
    lengths than the export's. Outputs are compared in float32 on the CPU.
    """
    sess = path_or_session
    if not isinstance(sess, ort.InferenceSession):
        sess = session(sess, device="auto" if module_device(module).type == "cuda" else "cpu")
    call = bind(module, example_inputs, example_kwargs)
    with torch.no_grad():
        expected = tensor_outputs(module(*call.args, **call.kwargs))
    got = run_session(sess, call)
    names = [out.name for out in sess.get_outputs()]
    if len(got) != len(expected):
        raise ExportError(f"the ONNX model has {len(got)} outputs {names}, the module returns "
                          f"{len(expected)} tensors")
    diffs = tuple(_compare(name, torch.from_numpy(np.asarray(actual)), reference, atol, rtol)
                  for name, actual, reference in zip(names, got, expected))
    return VerifyReport(diffs, tuple(sess.get_providers()), atol, rtol)


def run_session(sess: ort.InferenceSession, call: Call) -> list:
    """Feed ``call``'s tensor inputs to ``sess`` in graph order; return its outputs."""
    inputs = sess.get_inputs()
    if len(inputs) != len(call.tensors):
        raise ExportError(f"the ONNX model takes {len(inputs)} inputs {[i.name for i in inputs]}, the "
                          f"example inputs hold {len(call.tensors)} tensors {call.names}")
    feed = {spec.name: tensor.detach().cpu().numpy() for spec, tensor in zip(inputs, call.tensors)}
    with reraise_as_export_error("onnxruntime inference"):
        return sess.run(None, feed)


def _compare(name: str, actual: torch.Tensor, reference: torch.Tensor, atol: float, rtol: float) -> OutputDiff:
    reference = reference.detach().float().cpu()
    actual = actual.float()
    shape = tuple(reference.shape)
    if actual.shape != reference.shape:
        return OutputDiff(name, shape, float("inf"), float("inf"), False)
    return OutputDiff(name, shape, max_abs_diff(actual, reference), relative_error(actual, reference),
                      bool(torch.allclose(actual, reference, atol=atol, rtol=rtol)))
