"""One model, three ways: eager PyTorch, torch.compile (Inductor) and onnxruntime, side by side."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from attnres_fx.api import rewrite
from attnres_fx.conversion import is_converted
from attnres_fx.checks import max_abs_diff, relative_error
from attnres_fx.text import format_table
from attnres_fx.timing import interleaved, median_ms

from .inductor import compile
from .onnx import to_onnx
from .runtime import run_session, session
from .signature import bind, module_device, tensor_outputs


def three_way_report(model_rewritten: nn.Module, inputs: Any, tmpdir: str | Path, *,
                     example_kwargs: dict | None = None, runs: int = 5) -> str:
    """Compile ``model_rewritten``, export it to ``<tmpdir>/model.onnx``, run all three on ``inputs`` and
    return a printable table: agreement with eager (max absolute difference over all outputs, and
    that relative to the largest eager magnitude), median time of ``runs`` calls, interleaved, after one warm-up, and
    the one-off compile / export times. onnxruntime runs on the model's device when it can.
    """
    if is_converted(model_rewritten):
        model_rewritten = rewrite(model_rewritten, inputs, example_kwargs=example_kwargs)
    call = bind(model_rewritten, inputs, example_kwargs)
    device = module_device(model_rewritten)

    def forward(module):
        return lambda: tensor_outputs(module(*call.args, **call.kwargs))

    start = time.perf_counter()
    path = to_onnx(model_rewritten, call.args, Path(tmpdir) / "model.onnx", example_kwargs=call.kwargs)
    export_s = time.perf_counter() - start
    sess = session(path, device="auto" if device.type == "cuda" else "cpu")
    with torch.no_grad():
        compiled = compile(model_rewritten)
        start = time.perf_counter()
        forward(compiled)()
        compile_s = time.perf_counter() - start
        runners = {"eager": forward(model_rewritten), "compiled": forward(compiled),
                   "onnxruntime": lambda: [torch.from_numpy(np.asarray(o)) for o in run_session(sess, call)]}
        outputs = {name: run() for name, run in runners.items()}
        ms = median_ms(interleaved(runners, runs, warmup=0, device=device))
    reference, compiled_out, ort_out = outputs["eager"], outputs["compiled"], outputs["onnxruntime"]
    eager_ms, compiled_ms, ort_ms = ms["eager"], ms["compiled"], ms["onnxruntime"]

    shapes = ", ".join(f"{name} {list(t.shape)}" for name, t in zip(call.names, call.tensors))
    rows = [("eager", "-", "-", f"{eager_ms:.2f}", ""),
            ("compiled", *_difference(compiled_out, reference), f"{compiled_ms:.2f}", f"compile {compile_s:.1f} s"),
            ("onnxruntime", *_difference(ort_out, reference), f"{ort_ms:.2f}",
             f"export {export_s:.1f} s, {sess.get_providers()[0]}")]
    return (f"eager vs compiled vs onnxruntime ({shapes}; {device}; median of {runs} runs)\n"
            + format_table(("backend", "max |diff|", "relative", "median ms", "one-off"), rows, indent="  "))


def _difference(outputs: list[torch.Tensor], reference: list[torch.Tensor]) -> tuple[str, str]:
    """Largest max-abs and relative difference over all outputs (:mod:`attnres_fx.checks`)."""
    pairs = [(o.float().cpu(), r.float().cpu()) for o, r in zip(outputs, reference)]
    return (f"{max(max_abs_diff(o, r) for o, r in pairs):.3e}", f"{max(relative_error(o, r) for o, r in pairs):.3e}")
