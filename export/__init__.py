"""Hand-off of converted models to torch.compile (Inductor) and ONNX / onnxruntime.

    from attnres_fx import export
    path = export.to_onnx(model, (ids,), "model.onnx")           # dynamic batch and sequence
    print(export.verify(model, path, (ids,)))                    # torch vs onnxruntime, per output
    export.attnres_node_groups(path)                             # {"model.layers.0.attn_res": [...], ...}
    fast = export.compile(graph)                                 # an explicit graph, Inductor fullgraph
    path = export.to_onnx(lm, (ids,), "decoder.onnx", with_cache=True)    # past keys/values in and out
    tokens = export.generate_onnx(export.session(path), ids, max_new_tokens=20)
    folder = export.to_genai(lm, "served", tokenizer=tokenizer)          # an onnxruntime-genai model folder
    tokens = export.generate_genai(folder, [[5, 6, 7], [8, 9]], max_new_tokens=20)   # served by it, greedily

Every failure raises :class:`attnres_fx.ExportError` with the root cause and a hint. The ONNX packages
are an optional extra (``pip install 'attnres-fx[onnx]'``; onnxruntime-genai, ``generate_genai``'s, is
``attnres-fx[genai]``): they are imported by the functions that need them, so ``export.compile`` works
without them.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "compile": "inductor",
    "to_onnx": "onnx", "attnres_node_groups": "onnx",
    "three_way_report": "report",
    "generate_onnx": "decoding",
    "to_genai": "genai",
    "generate_genai": "genai_runtime",
    "OutputDiff": "runtime", "VerifyReport": "runtime", "session": "runtime", "verify": "runtime",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
