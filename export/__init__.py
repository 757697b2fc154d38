"""Hand-off of rewritten modules to torch.compile (Inductor) and ONNX / onnxruntime.

    from attnres_fx import export
    fast = export.compile(new)                                   # Inductor, fullgraph=True
    path = export.to_onnx(new, (ids,), "model.onnx")             # dynamic batch and sequence
    print(export.verify(new, path, (ids,)))                      # torch vs onnxruntime, per output
    export.attnres_node_groups(path)                             # {"blocks.0.attn_res": [...], ...}

Every failure raises :class:`attnres_fx.ExportError` with the root cause and a hint.
"""

from .compile import compile
from .onnx import attnres_node_groups, to_onnx
from .report import three_way_report
from .runtime import OutputDiff, VerifyReport, session, verify

__all__ = ["OutputDiff", "VerifyReport", "attnres_node_groups", "compile", "session", "three_way_report",
           "to_onnx", "verify"]
