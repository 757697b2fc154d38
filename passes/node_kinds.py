"""Node predicates: what a node *is*, independent of the IR that produced it.

Three IRs reach the passes: torch.fx symbolic tracing (``call_module`` leaves, ``call_method``, Python
operators), torch.export (``aten`` overloads, parameters as ``get_attr``) and TorchDynamo (torch-level
functions, modules inlined, parameters as ``placeholder`` inputs). Everything here reduces a node to a
canonical op name (``"add"``, ``"layer_norm"``, ``"rsqrt"``) and a module path (``model.layers.3``) so
that detection is written once, on data flow, for all three.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable

import torch
from torch import fx, nn

NORM_MODULES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase,
                nn.LocalResponseNorm)
ACTIVATION_MODULES = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.Softplus, nn.ELU,
                      nn.LeakyReLU, nn.Hardswish, nn.GLU)
ATTENTION_MODULES = (nn.MultiheadAttention,)

ADD_OPS = {"add", "iadd", "add_", "__add__", "__iadd__", "__radd__"}
SHAPE_OPS = {"size", "dim", "numel", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset",
             "getattr", "len", "_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size"}
CAST_OPS = {"to", "type", "float", "half", "bfloat16", "double", "type_as", "_to_copy", "contiguous",
            "clone", "alias", "_to_dtype", "identity"}
DROPOUT_OPS = {"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "dropout_",
               "dropout1d", "dropout2d", "dropout3d"}
NORM_OPS = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm",
            "native_group_norm", "batch_norm", "instance_norm"}
MATMUL_OPS = {"linear", "matmul", "__matmul__", "mm", "addmm", "bmm", "baddbmm", "einsum", "mv", "addmv",
              "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d",
              "conv_transpose2d", "conv_transpose3d", "bilinear", "tensordot"}
ATTENTION_OPS = {"softmax", "_softmax", "_safe_softmax", "scaled_dot_product_attention",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
                 "flex_attention"}
ACTIVATION_OPS = {"gelu", "relu", "silu", "tanh", "sigmoid", "mish", "softplus", "elu", "leaky_relu",
                  "hardswish", "glu", "relu_", "gelu_", "silu_"}
SQUARE_OPS = {"pow", "square"}
RSQRT_OPS = {"rsqrt"}
MEAN_OPS = {"mean"}
MUL_OPS = {"mul", "imul", "__mul__", "mul_"}


def op_name(node: fx.Node) -> str:
    """Canonical lowercase name of the operation a node performs ('' for non-ops)."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return ""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def submodule(gm: nn.Module, node: fx.Node) -> nn.Module | None:
    """The module a ``call_module`` node calls, or None."""
    if node.op != "call_module":
        return None
    return get_submodule_or_none(gm, str(node.target))


def get_submodule_or_none(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def is_add(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in (operator.add, operator.iadd):
        return True
    return op_name(node) in ADD_OPS


def add_operands(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The two tensor operands of a plain ``a + b``, or None (scalar operand, ``alpha != 1``...)."""
    if not is_add(node):
        return None
    args = list(node.args[:2])
    if len(args) < 2 and "other" in node.kwargs:
        args.append(node.kwargs["other"])
    if len(args) < 2 or not all(isinstance(a, fx.Node) for a in args):
        return None
    alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
    if alpha != 1:
        return None
    return args[0], args[1]


def is_shape_query(node: fx.Node) -> bool:
    """Reads only a tensor's metadata (shape, dtype, device): not a data dependency."""
    return op_name(node) in SHAPE_OPS


def is_inactive_dropout(node: fx.Node, gm: fx.GraphModule) -> bool:
    """A dropout that is the identity: eval-mode module, ``training=False`` or ``p == 0``."""
    module = submodule(gm, node)
    if module is not None:
        return isinstance(module, nn.modules.dropout._DropoutNd) and (not module.training or module.p == 0)
    if op_name(node) not in DROPOUT_OPS:
        return False
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    train = node.kwargs.get("training", node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True))
    return train is False or p == 0


def is_transparent(node: fx.Node, gm: fx.GraphModule) -> bool:
    """An identity on values (dtype casts, copies, eval-mode dropout): seen through on the stream."""
    module = submodule(gm, node)
    if module is not None:
        return isinstance(module, nn.Identity) or is_inactive_dropout(node, gm)
    return op_name(node) in CAST_OPS or is_inactive_dropout(node, gm)


DTYPE_OF_SECOND_OPS = {"type_as", "to"}


def data_inputs(node: fx.Node) -> Iterable[fx.Node]:
    """Inputs whose *values* the node depends on (shape queries depend on none; ``y.type_as(x)``
    and ``y.to(x)`` read only ``x``'s dtype)."""
    if is_shape_query(node):
        return ()
    if op_name(node) in DTYPE_OF_SECOND_OPS and node.args and isinstance(node.args[0], fx.Node):
        return [node.args[0]]
    return node.all_input_nodes


def reads_value(user: fx.Node, value: fx.Node) -> bool:
    """Whether ``user`` depends on ``value``'s data, not just on its shape or dtype."""
    return value in data_inputs(user)


def is_norm_module(module: nn.Module | None) -> bool:
    return isinstance(module, NORM_MODULES)


def is_norm_op(node: fx.Node, gm: fx.GraphModule) -> bool:
    """A single normalisation op: a norm module call or a functional / aten norm."""
    module = submodule(gm, node)
    if module is not None:
        return is_norm_module(module)
    return op_name(node) in NORM_OPS


def is_parameter(node: fx.Node) -> bool:
    """A learned weight: ``get_attr`` (fx, export) or a Dynamo ``placeholder`` holding an ``nn.Parameter``."""
    if node.op == "get_attr":
        return True
    return node.op == "placeholder" and isinstance(node.meta.get("example_value"), nn.Parameter)


def parameter_derived_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computed from parameters/buffers alone (weights, and ops such as ``t(weight)``)."""
    derived: set[fx.Node] = set()
    for node in graph.nodes:
        if is_parameter(node):
            derived.add(node)
        elif node.op in ("call_function", "call_method"):
            inputs = node.all_input_nodes
            if inputs and all(i in derived for i in inputs):
                derived.add(node)
    return derived


def is_parameterised_compute(node: fx.Node, gm: fx.GraphModule, param_derived: set[fx.Node]) -> bool:
    """A Linear / matmul / conv with learned weights: what makes an add's operand a *branch*."""
    module = submodule(gm, node)
    if module is not None:
        has_params = any(True for _ in module.parameters())
        return has_params and not is_norm_module(module) and not isinstance(module, nn.Embedding)
    if op_name(node) not in MATMUL_OPS:
        return False
    return any(i in param_derived for i in node.all_input_nodes)


def is_attention(node: fx.Node, gm: fx.GraphModule) -> bool:
    module = submodule(gm, node)
    if module is not None:
        return isinstance(module, ATTENTION_MODULES)
    return op_name(node) in ATTENTION_OPS


def is_activation(node: fx.Node, gm: fx.GraphModule) -> bool:
    module = submodule(gm, node)
    if module is not None:
        return isinstance(module, ACTIVATION_MODULES)
    return op_name(node) in ACTIVATION_OPS


def module_stack(node: fx.Node) -> list[tuple[str, str]]:
    """``[(path, class name), ...]`` outermost first, from ``nn_module_stack`` (fx and export)."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for value in stack.values():
        path, cls = value[0], value[1] if len(value) > 1 else ""
        cls_name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
        out.append((_clean_path(str(path)), cls_name.rsplit(".", 1)[-1]))
    return out


_SOURCE_ROOT = re.compile(r"^[LG]\[[^\]]*\](\[\d+\])*")          # L['self'], G['m'], L['args'][0]
_MODULES_ITEM = re.compile(r"\._modules\['([^']*)'\]")             # ._modules['layers'] -> .layers
# An instance attribute ``forward`` (the wrapper attnres_fx.live installs on a module it routes) is no
# submodule: nn.Module forbids a submodule named ``forward``, so the segment can be dropped safely.
_FORWARD_WRAPPER = re.compile(r"\.forward\.[A-Za-z_]\w*(\.__self__)?")
_INDEX = re.compile(r"\[(\d+)\]")


def _clean_path(path: str) -> str:
    """Dotted module path (``decoder.block.0``) from an fx/export path or a Dynamo source expression
    (``L['self'].decoder.forward.module.block[0]``)."""
    path = _SOURCE_ROOT.sub("", path)
    path = _MODULES_ITEM.sub(r".\1", path)
    path = _FORWARD_WRAPPER.sub("", path)
    path = _INDEX.sub(r".\1", path)
    return path.replace("['", ".").replace("']", "").strip(".")


def owner_path(node: fx.Node) -> str:
    """Dotted path of the innermost module whose forward created ``node`` ('' for the root)."""
    stack = module_stack(node)
    return stack[-1][0] if stack else ""


def node_module_path(node: fx.Node) -> str:
    """The module a node belongs to: its ``call_module`` target, else its owner."""
    if node.op == "call_module":
        return str(node.target)
    return owner_path(node)


def _through_casts(node: fx.Node, gm: fx.GraphModule) -> fx.Node:
    while len(node.users) == 1:
        (user,) = node.users
        if not is_transparent(user, gm):
            break
        node = user
    return node


def _cast_aliases(x: fx.Node, gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """``x`` and the dtype casts / copies of it (``x.to(float32)``), each mapped to the user of ``x`` its
    chain starts with (``x`` to itself)."""
    aliases = {x: x}
    todo = [(x, None)]
    while todo:
        node, root = todo.pop()
        for user in node.users:
            if user not in aliases and is_transparent(user, gm):
                aliases[user] = root or user
                todo.append((user, root or user))
    return aliases


def _decomposed_rms_users(x: fx.Node, gm: fx.GraphModule) -> set[fx.Node]:
    """Users of ``x`` that belong to a written-out ``x * rsqrt(mean(x**2) + eps)``; empty if none.

    Accepts ``pow(x, 2)``, ``square(x)`` or ``x * x``, an optional ``+ eps``, dtype casts anywhere (the
    square of ``x.to(float32)`` multiplying ``x`` itself, as T5 writes it), and the multiplication by
    ``x`` in either operand order.
    """
    aliases = _cast_aliases(x, gm)
    for alias in aliases:
        for square in alias.users:
            name = op_name(square)
            is_square = (name in SQUARE_OPS and (name == "square" or square.args[1:2] == (2,))) or (
                name in MUL_OPS and len(square.args) == 2 and square.args[0] is alias and square.args[1] is alias)
            if not is_square:
                continue
            mean = _through_casts(square, gm)
            mean = next((u for u in mean.users if op_name(u) in MEAN_OPS), None)
            if mean is None:
                continue
            scale = _through_casts(mean, gm)
            eps_add = next((u for u in scale.users if is_add(u) and add_operands(u) is None), None)
            scale = _through_casts(eps_add, gm) if eps_add is not None else scale
            rsqrt = next((u for u in scale.users if op_name(u) in RSQRT_OPS), None)
            if rsqrt is None:
                continue
            rsqrt = _through_casts(rsqrt, gm)
            normalise = next((u for u in rsqrt.users if op_name(u) in MUL_OPS
                              and any(a in aliases for a in u.args if isinstance(a, fx.Node))), None)
            if normalise is not None:
                scaled = next(a for a in normalise.args if isinstance(a, fx.Node) and a in aliases)
                return {square, normalise, aliases[alias], aliases[scaled]}
    return set()


def reads_normalised(value: fx.Node, readers: Iterable[fx.Node], gm: fx.GraphModule) -> bool:
    """Whether every one of ``readers`` (users of ``value``) feeds ``value`` only into a normalisation.

    Recognises norm modules, functional / aten norms, and RMSNorm written out with optional dtype
    casts in front (``x.to(float32)`` then ``x * rsqrt(mean(x**2) + eps)``).
    """
    readers = [r for r in readers if reads_value(r, value)]
    if not readers:
        return False
    decomposed = _decomposed_rms_users(value, gm)
    for reader in readers:
        if is_norm_op(reader, gm) or reader in decomposed:
            continue
        if is_transparent(reader, gm) and reads_normalised(reader, list(reader.users), gm):
            continue
        return False
    return True
