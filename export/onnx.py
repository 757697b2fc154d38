"""ONNX export of a rewritten module, and finding the BlockAttnRes aggregations in the exported graph.

The export is done in two explicit steps, ``torch.export.export(strict=False)`` then the dynamo-based
``torch.onnx.export`` of the resulting ``ExportedProgram``: one capture strategy (``torch.onnx.export``
of a module would retry strict and draft modes, slowly and noisily, on a model that cannot export),
and control over the keyword-input order that the graph's inputs follow.

Provenance: the dynamo exporter writes each ONNX node's module stack into its ``metadata_props``:
``pkg.torch.onnx.name_scopes`` (module paths, outermost first, then the aten node) and
``pkg.torch.onnx.class_hierarchy`` (the classes of the same modules). Node names are only the aten
node names (``node_mul_19``), so :func:`attnres_node_groups` reads the metadata.
"""

from __future__ import annotations

import ast
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import nn

from attnres_fx import atomic
from attnres_fx.op import ops
from attnres_fx.api import explicit_graph, rewrite
from attnres_fx.op.module import BlockAttnRes
from attnres_fx.errors import AttnResWarning, ExportError
from attnres_fx.capture.tracers import default_dynamic_shapes
from attnres_fx.compat import hf_onnx_translations, unwrapped
from attnres_fx.conversion import is_converted
from attnres_fx.passes.two_phase import can_apply_two_phase

from . import decoding
from .failures import reraise_as_export_error
from .runtime import verify
from .schedule import inference_form
from .signature import bind, output_names

NAME_SCOPES = "pkg.torch.onnx.name_scopes"
CLASS_HIERARCHY = "pkg.torch.onnx.class_hierarchy"
_ATTNRES_CLASS = f"{BlockAttnRes.__module__}.{BlockAttnRes.__qualname__}"


def to_onnx(module: nn.Module, example_inputs: Any, path: str | Path, *, example_kwargs: dict | None = None,
            dynamic: bool = True, opset: int | None = None, external_data: bool | None = None,
            two_phase: bool = True, with_cache: bool = False, check: bool = True) -> Path:
    """Export ``module`` to an ONNX file at ``path`` and check it with ``onnx.checker``; return the path.

    The file (and its ``.data``) is written and checked beside ``path`` and moved in once it passed: a
    failure, an interrupt or a full disk leaves ``path`` as it was (a ``.data`` of an earlier export that
    this one does not have is deleted with it).

    Args:
        module: a model converted by ``attnresify`` (exported through its explicit graph,
            :func:`attnres_fx.rewrite`, with its current weights), an explicit graph, or any ``nn.Module``
            (a ``compile()``d module is exported from its original). Its weights' device is where the
            example inputs go.
        example_inputs: positional inputs (a tuple, or one tensor).
        example_kwargs: keyword inputs.
        dynamic: batch and sequence dimensions (the first two) of every tensor input are dynamic, so
            the model runs at other batch sizes and lengths. torch.export fixes a dimension whose
            example size is 1, or that the model itself constrains (e.g. ViT's patch count).
        opset: ONNX opset version (default: the exporter's).
        external_data: store weights in ``<path>.data`` beside the model. ``None``: automatically when
            the initializers exceed 1.5 GB (a protobuf cannot exceed 2 GB, so ``False`` cannot force
            a larger model into one file).
        two_phase: export the two-phase inference schedule (:mod:`attnres_fx.passes.two_phase`):
            each completed block is read once per block instead of once per site. Exact; ``False``
            exports the per-site form, one node group per BlockAttnRes.
        with_cache: export a Hugging Face decoder LM for decoding: the KV cache as inputs and outputs
            (:mod:`attnres_fx.export.decoding`, ``optimum``'s layout; the example ``input_ids``, first
            positional input or keyword, are all it reads). Batch, sequence and past length are dynamic;
            :func:`attnres_fx.export.generate_onnx` decodes with it.
        check: run the ONNX model in onnxruntime on the example inputs and compare it with ``module``
            (fp32 and fp64 models, without the cache): an exporter can translate a graph into one that
            computes something else without an error (LongT5's local attention, through an explicit
            graph). A model that disagrees (neither element-wise within 1e-3 nor per row within 1e-2 of
            the row's norm: rounding of a deep model reaches the first, not the second) is deleted again
            and raises :class:`attnres_fx.ExportError` with the comparison.

    Graph inputs are named after ``forward()``'s parameters (``ids``, ``input_ids``); outputs after
    the output's keys (``logits``, ``last_hidden_state``), ``output_<i>`` for a tuple, and ``logits``
    / ``output`` for a single tensor. Every failure raises :class:`attnres_fx.ExportError` with the
    exporter's root cause and a hint.
    """
    module = source = unwrapped(module)
    if with_cache:
        module, args, kwargs, dynamic_shapes, names_in, names_out = _decoder_with_cache(module, example_inputs,
                                                                                        example_kwargs)
    else:
        if is_converted(module):
            module = rewrite(module, example_inputs, example_kwargs=example_kwargs)
        call = bind(module, example_inputs, example_kwargs)
        args, kwargs, names_in = call.args, call.kwargs, call.names
        dynamic_shapes = default_dynamic_shapes(module, args, kwargs) if dynamic else None
        if dynamic:
            _warn_size_one(call.names, call.tensors)
        with reraise_as_export_error("running the module on the example inputs"), torch.no_grad():
            names_out = output_names(module, module(*args, **kwargs))
    path = Path(path)
    # Written and checked beside the target, then moved in with its .data: a failure leaves it as it was.
    with atomic.replaced_files(path, onnx_files) as staged:
        write_onnx(module, args, kwargs, dynamic_shapes, names_in, names_out, staged, opset=opset,
                   external_data=external_data, two_phase=two_phase, target=path)
        if check and not with_cache and _checkable(source):
            try:
                _refuse_if_it_disagrees(source, staged, example_inputs, example_kwargs, path)
            except ExportError:
                if not (two_phase and can_apply_two_phase(module)):
                    raise
                # The exporter mistranslated the two-phase graph (WavLM's): the per-site form, checked too.
                write_onnx(module, args, kwargs, dynamic_shapes, names_in, names_out, staged, opset=opset,
                           external_data=external_data, two_phase=False, target=path)
                _refuse_if_it_disagrees(source, staged, example_inputs, example_kwargs, path)
                warnings.warn(f"{path}: the exporter translated the two-phase schedule of {type(source).__name__} "
                              "into a graph that computes something else on the example inputs; it is written in "
                              "the per-site form, which agrees (two_phase=False exports that form at once)",
                              AttnResWarning, stacklevel=2)
    return path


def onnx_files(path: Path) -> list[Path]:
    """An ONNX model's files: the graph and its external data beside it."""
    return [path, Path(f"{path}.data")]


def write_onnx(module: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any, input_names: list[str],
               output_names: list[str], path: str | Path, *, opset: int | None = None,
               external_data: bool | None = None, two_phase: bool = True, target: Path | None = None) -> Path:
    """Export ``module`` called with ``(args, kwargs)`` to ``path``, its graph inputs and outputs named as
    given, and check it with ``onnx.checker``: the step every ONNX export of this package ends with.
    ``module`` is a plain module or an explicit graph; ``target``: the file errors name (where ``path``
    is a temporary one); the other options are :func:`to_onnx`'s."""
    module = inference_form(module, two_phase)
    path = Path(path)
    with reraise_as_export_error("torch.export"):
        program = torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
        if any(node.target in ops.EXPORT_DECOMPOSITIONS for node in program.graph.nodes):
            # A model that calls torch.ops.attnres.aggregate itself: its plain-op form, which ONNX holds.
            program = program.run_decompositions(ops.EXPORT_DECOMPOSITIONS)
    with reraise_as_export_error("ONNX conversion"):
        onnx_program = torch.onnx.export(program, dynamo=True, input_names=input_names,
                                         output_names=output_names, opset_version=opset, verbose=False,
                                         custom_translation_table=hf_onnx_translations(program) or None)
    path.parent.mkdir(parents=True, exist_ok=True)
    with reraise_as_export_error(f"saving {target or path}"):
        onnx_program.save(path, external_data=external_data)
    with reraise_as_export_error(f"onnx.checker of {target or path}"):
        # The path, not a loaded proto: the checker then reads external data itself, past 2 GB.
        onnx.checker.check_model(str(path))
    return path


# Agreement required of an export: element-wise, or per row (token) relative to the row's norm, since
# rounding grows with depth (1.4e-3 on logits of a 12-layer, d=512 model: 8e-4 of the row). Well above
# onnxruntime's own rounding either way, well below a wrong translation.
CHECK_TOLERANCE = 1e-3
CHECK_ROW_TOLERANCE = 1e-2


def _checkable(module: nn.Module) -> bool:
    """Whether onnxruntime on the CPU reproduces ``module`` closely enough to judge it: fp32 and fp64."""
    return {p.dtype for p in module.parameters() if p.dtype.is_floating_point} <= {torch.float32, torch.float64}


def _refuse_if_it_disagrees(module: nn.Module, path: Path, example_inputs: Any, example_kwargs: dict | None,
                            target: Path) -> None:
    with reraise_as_export_error(f"running {target} in onnxruntime"):
        report = verify(module, path, example_inputs, example_kwargs=example_kwargs, atol=CHECK_TOLERANCE,
                        rtol=CHECK_TOLERANCE)
    if all(out.ok or out.max_rel <= CHECK_ROW_TOLERANCE for out in report.outputs):
        return
    raise ExportError(f"the ONNX model computes something else than {type(module).__name__} on the example "
                      f"inputs, so it was not written ({target} is as it was):\n{report}\n(nor per row within "
                      f"{CHECK_ROW_TOLERANCE:g} "
                      "of the row's norm). The exporter translated a graph it "
                      "took without an error into a wrong one. Export the model without AttnRes to see whether "
                      "the exporter handles it; check=False keeps such a model for inspection.")


def _decoder_with_cache(model: nn.Module, example_inputs: Any, example_kwargs: dict | None):
    """The cache-carrying decoder graph of ``model`` (its AttnRes rewrite when it is converted) and how
    to export it; the example ``input_ids`` are the first positional input or the keyword one."""
    if isinstance(example_inputs, torch.Tensor):
        ids = example_inputs
    elif example_inputs:
        ids = example_inputs[0]
    elif example_kwargs and "input_ids" in example_kwargs:
        ids = example_kwargs["input_ids"]
    else:
        raise ExportError("with_cache=True needs example input_ids (positional or keyword)")
    # A slice of a larger batch (ids[:2, :8]) has the larger batch's strides, which torch.export would
    # take for the model's.
    ids = ids.contiguous()
    layers = decoding.cache_shape(model)[0]
    wrapper = decoding.DecoderWithCache(model).train(model.training)
    args, dynamic_shapes = decoding.example_call(model, ids)
    if is_converted(model):
        wrapper = explicit_graph(wrapper, model, "model", args, None, "export", dynamic_shapes)
    return wrapper, args, {}, dynamic_shapes, decoding.input_names(layers), decoding.output_names(layers)


def attnres_node_groups(model: onnx.ModelProto | str | Path) -> dict[str, list[str]]:
    """Site name (``blocks.0.attn_res``) -> names of the ONNX nodes computed inside that BlockAttnRes.

    Sites appear in graph order. Nodes in subgraphs (``If`` / ``Loop`` bodies) count too. A site that
    exports to no node at all has no entry (after :mod:`attnres_fx.passes.two_phase`, a first site's
    single-source aggregation is the identity). A model exported by something other than the dynamo
    exporter has no provenance metadata: the result is empty.
    """
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    groups: dict[str, list[str]] = {}
    for node in _nodes(model.graph):
        site = _attnres_scope(node)
        if site is not None:
            groups.setdefault(site, []).append(node.name)
    return groups


def _attnres_scope(node: onnx.NodeProto) -> str | None:
    props = {prop.key: prop.value for prop in node.metadata_props}
    if NAME_SCOPES not in props or CLASS_HIERARCHY not in props:
        return None
    scopes = ast.literal_eval(props[NAME_SCOPES])
    classes = ast.literal_eval(props[CLASS_HIERARCHY])
    return next((scope for scope, cls in zip(scopes, classes) if cls == _ATTNRES_CLASS), None)


def _nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield from _nodes(attribute.g)
            for subgraph in attribute.graphs:
                yield from _nodes(subgraph)


def _warn_size_one(names: list[str], tensors: list[torch.Tensor]) -> None:
    fixed = [f"{name}.shape[{d}]" for name, t in zip(names, tensors) for d in range(min(2, t.dim()))
             if t.shape[d] == 1]
    if fixed:
        warnings.warn(f"example size 1 at {', '.join(fixed)}: torch.export specialises size-1 dimensions, "
                      "so the ONNX model will only accept size 1 there. Export with sizes >= 2 to keep "
                      "them dynamic.", AttnResWarning, stacklevel=3)
