"""A site's aggregation and the norm that alone reads its result, made one call: the layer route's eager
block code.

Once a pre-norm block's residual adds are rewritten, what a site aggregates is read by the sublayer's norm
alone (``attention_norm(run_site(...))``). Where that norm module computes ``x * rsqrt(mean(x ** 2, -1) +
eps) * weight``, or Gemma's ``* (1 + weight)`` (the operator then takes ``1 + weight`` as its weight, added
as the module adds it), or calls ``layer_norm(x, (D,), weight, bias, eps)`` (``nn.LayerNorm``; matched on
the module's own fx graph: :func:`match_norm`), the two calls become one
:func:`~attnres_fx.op.module.site_normed` call. Without gradients the C++ kernel runs both as one operator:
each result row is normalised while it is still in cache, and a decoding step makes one call where the
norm alone made some six (pow, mean, add, rsqrt and two products). With gradients the same operator
records one C++ node for both, which keeps what the aggregation's node keeps and the norm's weight but not
the aggregate: its backward recomputes each row from the sources it reads anyway and runs the norm's
backward on it in cache (where the module's ops make some six passes forward and ten backward, and keep
their input). Where it cannot take the call when it runs
(hooks on either module, another module put in the norm's place, its class's forward replaced, a constant
of the norm other than its eps changed (the blocks of one kind share their code, whatever their norms'
constants), not fp32, a tensor subclass, TorchDynamo tracing), the call is ``norm(run_site(...))`` as before.

Contract
    requires  a rewritten block graph whose aggregations are :func:`~attnres_fx.op.module.run_site` calls.
    ensures   each ``run_site`` call read only by a ``call_module`` of a matched norm (its one argument)
              is replaced, with that call, by one ``site_normed`` call taking the site's module, the norm
              module (read by ``read_module``) and the site's sources; the graph lints.
    modifies  the graph, in place. ``preserves_computation``: the result and its gradients equal the
              two modules' up to fp32 rounding (the norm's sums in another order, ``1 / sqrt`` for
              ``rsqrt``: a few units in the last place, about 1e-6 relative).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import fx, nn

from attnres_fx.capture.block_tracer import module_constants
from attnres_fx.op.module import FusedNorm, run_site, site_normed

from .matching import FailedMatch
from .node_kinds import MEAN_OPS, MUL_OPS, RSQRT_OPS, SQUARE_OPS, is_add, op_name

# Casts that leave an fp32 tensor as it is (site_normed fuses fp32 calls only).
_CASTS = {"to", "type", "float", "type_as"}


def fuse_site_norms(gm: fx.GraphModule, read_module: Callable[[fx.Graph, fx.Node], fx.Node],
                    match: Callable[[nn.Module], FusedNorm | FailedMatch]) -> int:
    """Fuse, in ``gm``, each site call read only by a norm module (see the module docstring); returns how
    many. ``read_module(graph, call)``: a node that gives the module a ``call_module`` node calls, inserted
    before it; ``match(module)``: :func:`match_norm` of the module and its graph."""
    graph = gm.graph
    fused = 0
    for call, user in list(_read_by_a_module(graph)):
        found = match(gm.get_submodule(str(user.target)))
        if not found:
            continue
        with graph.inserting_before(user):
            norm = read_module(graph, user)
            fused_call = graph.call_function(site_normed(found), (call.args[0], norm, *call.args[1:]))
        user.replace_all_uses_with(fused_call)
        graph.erase_node(user)
        graph.erase_node(call)
        fused += 1
    if fused:
        graph.lint()
    return fused


def fusable(gm: fx.GraphModule, match: Callable[[nn.Module], FusedNorm | FailedMatch]) -> bool:
    """Whether :func:`fuse_site_norms` would fuse a call of ``gm`` (``gm`` left as it is)."""
    return any(match(gm.get_submodule(str(user.target))) for _, user in _read_by_a_module(gm.graph))


def _read_by_a_module(graph: fx.Graph):
    """``(call, user)``: each site call whose result only a module's call reads, as its one argument."""
    for call in graph.find_nodes(op="call_function", target=run_site):
        if len(call.users) == 1:
            (user,) = call.users
            if user.op == "call_module" and user.args == (call,) and not user.kwargs:
                yield call, user


class _Norm(NamedTuple):
    """What a norm's graph computes: ``weight`` (a ``get_attr``) plus ``offset``, its eps, and for a layer norm
    (``centred``) its bias (a ``get_attr``, or None)."""

    weight: fx.Node
    offset: float
    eps: float
    centred: bool = False
    bias: fx.Node | None = None


def match_norm(module: nn.Module, graph: fx.Graph) -> FusedNorm | FailedMatch:
    """What :func:`~attnres_fx.op.module.site_normed` needs of ``module``, given ``graph``, its forward's graph
    (:func:`attnres_fx.capture.block_tracer.module_graph`), where that computes ``x * rsqrt(mean(x ** 2, -1,
    keepdim=True) + eps) * weight`` of its one input (the three factors in any order, ``pow(x, 2)``,
    ``square(x)`` or ``x * x``, casts to float32 and back to the input's dtype seen through) or calls
    ``rms_norm(x, (D,), weight, eps)``, with ``weight`` a ``[D]`` parameter of its own, or that parameter plus
    a float constant (Gemma's ``1 + weight``: ``FusedNorm.weight_offset``); or calls ``layer_norm(x, (D,),
    weight, bias, eps)`` (``nn.LayerNorm``), ``bias`` a ``[D]`` parameter of its own or None; ``eps`` a float
    attribute of its own (read when the call runs). Else a :class:`FailedMatch`."""
    inputs = graph.find_nodes(op="placeholder")
    (output,) = graph.find_nodes(op="output")
    result = output.args[0]
    if len(inputs) != 1 or not isinstance(result, fx.Node):
        return FailedMatch(lambda: "its forward does not take one tensor and return one")
    x = inputs[0]
    parts = _layer_norm_call(result, x) or _rms_norm_call(result, x) or _written_out(result, x)
    if not parts:
        return FailedMatch(lambda: "its forward computes no RMS norm or layer norm of its input times a weight")
    weight_node, offset, eps = parts.weight, parts.offset, parts.eps
    weight = module._parameters.get(weight_node.target) if weight_node.op == "get_attr" else None
    if weight is None or weight.dim() != 1:
        return FailedMatch(lambda: "its weight is no [D] parameter of its own")
    bias = module._parameters.get(parts.bias.target) if parts.bias is not None else None
    if parts.bias is not None and (bias is None or bias.shape != weight.shape):
        return FailedMatch(lambda: "its bias is no [D] parameter of its own")
    names = [name for name, value in vars(module).items() if type(value) is float and value == eps]
    if not names:
        return FailedMatch(lambda: f"its eps ({eps!r}) is no float attribute of its own")
    # The attribute named like an epsilon where several hold the value.
    name = next((name for name in names if "eps" in name.lower()), names[0])
    constants = (("training", module.training),
                 *((key, value) for key, _, value in module_constants(module) if key != name))
    return FusedNorm(type(module), type(module).forward, weight_node.target, name, constants, offset,
                     parts.centred, parts.bias.target if parts.bias is not None else None)


def _layer_norm_call(result: fx.Node, x: fx.Node) -> _Norm | None:
    """``layer_norm(x, (D,), weight, bias, eps)``, ``weight`` read as it is, ``bias`` too or None."""
    arguments = _norm_call(result, x, (torch.nn.functional.layer_norm, torch.layer_norm),
                           ("input", "normalized_shape", "weight", "bias", "eps"))
    if arguments is None:
        return None
    weight, bias = arguments.get("weight"), arguments.get("bias")
    if _weight(weight, x) != (weight, 0.0) or not (bias is None or _weight(bias, x) == (bias, 0.0)):
        return None
    return _Norm(weight, 0.0, arguments["eps"], centred=True, bias=bias)


def _rms_norm_call(result: fx.Node, x: fx.Node) -> _Norm | None:
    """``rms_norm(x, (D,), offset + weight, eps)`` (``offset`` 0.0 where the weight is given as it is)."""
    arguments = _norm_call(result, x, (torch.nn.functional.rms_norm, torch.rms_norm),
                           ("input", "normalized_shape", "weight", "eps"))
    weighted = _weight(arguments.get("weight"), x) if arguments is not None else None
    return _Norm(*weighted, arguments["eps"]) if weighted is not None else None


def _norm_call(result: fx.Node, x: fx.Node, targets: tuple, names: tuple[str, ...]) -> dict | None:
    """The arguments by name where ``result`` calls one of ``targets`` (whose parameters are ``names``) on
    ``x`` (casts seen through) over its last dimension, with a float ``eps``; else None."""
    if result.op != "call_function" or result.target not in targets:
        return None
    arguments = dict(zip(names, result.args)) | dict(result.kwargs)
    shape = arguments.get("normalized_shape")
    if (_uncast(arguments.get("input"), x) is not x or not isinstance(shape, (tuple, list)) or len(shape) != 1
            or type(arguments.get("eps")) is not float):
        return None
    return arguments


def _written_out(result: fx.Node, x: fx.Node) -> _Norm | None:
    """A product of ``x``, ``rsqrt(mean(x ** 2) + eps)`` and ``weight`` or ``offset + weight`` (Gemma's
    ``1 + weight``)."""
    factors = _factors(result, x)
    plain = [factor for factor in factors if factor is x]
    scales = [eps for factor in factors if (eps := _inverse_rms(factor, x)) is not None]
    weights = [weighted for factor in factors if (weighted := _weight(factor, x)) is not None]
    if len(factors) != 3 or len(plain) != 1 or len(scales) != 1 or len(weights) != 1:
        return None
    return _Norm(*weights[0], scales[0])


def _weight(node, x: fx.Node) -> tuple[fx.Node, float] | None:
    """``(weight, offset)`` where ``node`` reads an attribute ``weight`` (offset 0.0) or adds a float constant
    ``offset`` to it (casts seen through)."""
    node = _uncast(node, x)
    if isinstance(node, fx.Node) and node.op == "get_attr":
        return node, 0.0
    if not isinstance(node, fx.Node) or not is_add(node) or len(node.args) != 2 or node.kwargs:
        return None
    weight, offset = node.args if isinstance(node.args[0], fx.Node) else node.args[::-1]
    weight = _uncast(weight, x)
    if type(offset) is not float or not isinstance(weight, fx.Node) or weight.op != "get_attr":
        return None
    return weight, offset


def _factors(node, x: fx.Node) -> list:
    """The factors of a product tree (casts seen through)."""
    node = _uncast(node, x)
    if (isinstance(node, fx.Node) and (op_name(node) in MUL_OPS or node.target is operator.mul)
            and len(node.args) == 2 and not node.kwargs):
        return _factors(node.args[0], x) + _factors(node.args[1], x)
    return [node]


def _inverse_rms(node, x: fx.Node) -> float | None:
    """``eps`` where ``node`` is ``rsqrt(mean(x ** 2, -1, keepdim=True) + eps)``."""
    if not isinstance(node, fx.Node) or op_name(node) not in RSQRT_OPS or len(node.args) != 1:
        return None
    total = _uncast(node.args[0], x)
    if not isinstance(total, fx.Node) or not is_add(total) or len(total.args) != 2 or total.kwargs:
        return None
    mean, eps = total.args if isinstance(total.args[0], fx.Node) else total.args[::-1]
    mean = _uncast(mean, x)
    if type(eps) is not float or not isinstance(mean, fx.Node) or op_name(mean) not in MEAN_OPS:
        return None
    arguments = dict(zip(("input", "dim", "keepdim"), mean.args)) | dict(mean.kwargs)
    if arguments.get("dim") not in (-1, (-1,), [-1]) or arguments.get("keepdim") is not True:
        return None
    return eps if _is_square_of(_uncast(arguments.get("input"), x), x) else None


def _is_square_of(node, x: fx.Node) -> bool:
    if not isinstance(node, fx.Node):
        return False
    name = op_name(node)
    operands = [_uncast(arg, x) for arg in node.args]
    if name == "square" or (name in SQUARE_OPS or node.target is operator.pow) and node.args[1:] == (2,):
        return operands[0] is x
    return (name in MUL_OPS or node.target is operator.mul) and len(operands) == 2 and operands[0] is x \
        and operands[1] is x


def _uncast(node, x: fx.Node):
    """``node`` through casts that leave an fp32 tensor as it is: to float32, to the input's own dtype, or
    like the input (``x.to(torch.float32)``, ``h.to(x.dtype)``, ``x.float()``, ``h.type_as(x)``)."""
    while isinstance(node, fx.Node) and op_name(node) in _CASTS and node.args:
        targets = [*node.args[1:], *node.kwargs.values()]
        if op_name(node) == "float" and not targets:
            node = node.args[0]
            continue
        if len(targets) != 1 or not _fp32_or_dtype_of(targets[0], x):
            break
        node = node.args[0]
    return node


def _fp32_or_dtype_of(target, x: fx.Node) -> bool:
    if target is torch.float32:
        return True
    if not isinstance(target, fx.Node):
        return False
    if target is x or _uncast(target, x) is x:
        return True       # type_as(x)
    # x.dtype, read before the casts
    return (target.op == "call_function" and target.target is getattr and target.args[0] is x
            and target.args[1] == "dtype")
