"""How a module's Python inputs and outputs map onto the flat, named inputs and outputs of an ONNX graph.

torch.export flattens ``(args, kwargs)`` and the output with ``torch.utils._pytree``, and the ONNX graph
keeps that order: positional inputs, then keyword inputs in the order they were passed, containers depth
first; only tensors become graph inputs/outputs (``None`` outputs are dropped). Keyword inputs are put in
``forward()``'s parameter order here, both when exporting and when feeding onnxruntime, so the two agree
whatever order a caller uses.

Names come from ``forward()``'s parameter names and from the output's keys (``ModelOutput`` field
names), so a graph reads ``input_ids -> logits`` rather than ``input_ids -> linear_14``.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnres_fx.capture.tracers import as_args
from attnres_fx.compat import pytree
from attnres_fx.errors import ExportError


@dataclass
class Call:
    """Example inputs bound to ``forward()``: what to call the module with, and the flat tensor inputs."""

    args: tuple
    kwargs: dict                 # in forward()'s parameter order
    names: list[str]             # one per tensor input, in graph order
    tensors: list[torch.Tensor]


def module_device(module: nn.Module) -> torch.device:
    """Where the module's weights live; inputs are moved there (CPU for a module without any)."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        return tensor.device
    return torch.device("cpu")


def bind(module: nn.Module, example_inputs: Any, example_kwargs: dict | None) -> Call:
    """Bind the example inputs to ``module.forward`` and move them to the module's device."""
    args = as_args(example_inputs) or ()
    device = module_device(module)
    args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device).contiguous(),
                                        (args, dict(example_kwargs or {})))
    signature = inspect.signature(module.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        raise ExportError(f"the example inputs do not match {type(module).__name__}.forward{signature}: "
                          f"{err}") from err
    positional: list[str] = []
    ordered: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            positional.extend(f"{name}_{i}" for i in range(len(value)))
        elif kind is inspect.Parameter.VAR_KEYWORD:
            ordered.update(value)
        elif name in kwargs:
            ordered[name] = value
        else:
            positional.append(name)
    named = named_tensors(dict(zip(positional, args)) | ordered)
    return Call(args, ordered, [name for name, _ in named], [tensor for _, tensor in named])


def named_tensors(tree: Any, root: str = "") -> list[tuple[str, torch.Tensor]]:
    """Tensor leaves of ``tree`` in pytree order, named by their key path (``past.0.key``)."""
    named = []
    for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            parts = [root] if root else []
            parts.extend(_key_name(key) for key in path)
            named.append((".".join(parts), leaf))
    return named


def output_names(module: nn.Module, output: Any) -> list[str]:
    """ONNX output names for ``module``'s ``output``: field names / keys, ``output_<i>`` for sequences.

    A single tensor is ``logits`` when its last dimension is the vocabulary of one of the module's
    embeddings (a language-model head), else ``output``.
    """
    constants = [(path, leaf) for path, leaf in pytree.tree_flatten_with_path(output)[0]
                 if leaf is not None and not isinstance(leaf, torch.Tensor)]
    if constants:
        where = ", ".join(f"{pytree.keystr(path) or 'output'} = {leaf!r}" for path, leaf in constants[:4])
        raise ExportError(f"{type(module).__name__}.forward returns non-tensor values ({where}); ONNX graph "
                          "outputs must be tensors. Return only tensors (for Hugging Face models: "
                          "use_cache=False, output_attentions=False).")
    if isinstance(output, torch.Tensor):
        vocabularies = {m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)}
        return ["logits" if output.dim() and output.shape[-1] in vocabularies else "output"]
    root = "output" if isinstance(output, (tuple, list)) else ""
    names = [name for name, _ in named_tensors(output, root)]
    return [name.replace("output.", "output_", 1) if root else name for name in names]


def tensor_outputs(output: Any) -> list[torch.Tensor]:
    """The output's tensors in graph order."""
    return [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]


def _key_name(key) -> str:
    if isinstance(key, pytree.MappingKey):
        return str(key.key)
    if isinstance(key, pytree.SequenceKey):
        return str(key.idx)
    if isinstance(key, pytree.GetAttrKey):
        return key.name
    return str(key)
