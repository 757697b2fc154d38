"""Node predicates: what a node *is*, independent of the IR that produced it.

Three IRs reach the passes: torch.fx symbolic tracing (``call_module`` leaves, ``call_method``, Python
operators), torch.export (``aten`` overloads, parameters as ``get_attr``) and TorchDynamo (torch-level
functions, modules inlined, parameters as ``placeholder`` inputs). Everything here reduces a node to a
canonical op name (``"add"``, ``"layer_norm"``, ``"rsqrt"``) and a module path (``model.layers.3``) so
that detection is written once, on data flow, for all three.
"""

from __future__ import annotations

import operator

from torch import fx, nn

from attnres_fx import compat
from attnres_fx.errors import UnsupportedArchitectureError

from . import provenance

NORM_MODULES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, compat.NormBase,
                nn.LocalResponseNorm)
ACTIVATION_MODULES = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.Softplus, nn.ELU,
                      nn.LeakyReLU, nn.Hardswish, nn.GLU)
ATTENTION_MODULES = (nn.MultiheadAttention,)

ADD_OPS = {"add", "iadd", "add_", "__add__", "__iadd__", "__radd__"}
SHAPE_OPS = {"size", "dim", "numel", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset",
             "getattr", "len", "_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size"}
# New tensors that take only the shape, dtype and device of their tensor argument.
LIKE_OPS = {"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
            "new_empty", "new_zeros", "new_ones", "new_full"}
# Ops that may reorganise the leading dimensions of a value; :func:`is_reshape` checks that the last
# (feature) dimension and the element order are kept.
RESHAPE_OPS = {"reshape", "view", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as",
               "reshape_as"}
# Results that alias their first argument (writes into them are writes into it).
VIEW_OPS = RESHAPE_OPS | {"getitem", "select", "slice", "narrow", "expand", "expand_as", "transpose", "permute",
                          "t", "as_strided", "diagonal", "split", "split_with_sizes", "chunk", "unbind",
                          "alias", "movedim", "unfold", "detach", "contiguous", "__getitem__"}
IN_PLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.ipow, operator.iand, operator.ior, operator.ixor}
CAST_OPS = {"to", "type", "float", "half", "bfloat16", "double", "type_as", "_to_copy", "contiguous",
            "clone", "alias", "_to_dtype", "identity"}
DROPOUT_OPS = {"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "dropout_",
               "dropout1d", "dropout2d", "dropout3d"}
NORM_OPS = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm",
            "native_group_norm", "batch_norm", "instance_norm"}
MATMUL_OPS = {"linear", "matmul", "__matmul__", "mm", "addmm", "bmm", "baddbmm", "einsum", "mv", "addmv",
              "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d",
              "conv_transpose2d", "conv_transpose3d", "bilinear", "tensordot"}
SOFTMAX_OPS = {"softmax", "_softmax", "_safe_softmax"}
ATTENTION_OPS = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_cudnn_attention", "flex_attention", "multi_head_attention_forward",
                 "_native_multi_head_attention"}
# Whole layers as one op (torch.nn's fused attention): parameterised compute like a Linear.
FUSED_LAYER_OPS = {"multi_head_attention_forward", "_native_multi_head_attention",
                   "_transformer_encoder_layer_fwd"}
# Ops that combine values along a dimension in order: scans over positions.
SCAN_OPS = {"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin", "associative_scan", "scan"}
# Ops that pick, per token, some of a set (experts): a mixture of experts' router.
ROUTING_OPS = {"topk", "argmax", "argsort", "sort", "multinomial"}
CONV_OPS = {"conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d",
            "conv_transpose2d", "conv_transpose3d"}
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
    if isinstance(target, compat.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, compat.OpOverloadPacket):
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
    operands = tensor_add_operands(node)
    if operands is None or add_alpha(node) != 1:
        return None
    return operands


def tensor_add_operands(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The two tensor operands of an add, whatever its ``alpha``; None if one is a scalar."""
    if not is_add(node):
        return None
    args = list(node.args[:2])
    if len(args) < 2 and "other" in node.kwargs:
        args.append(node.kwargs["other"])
    if len(args) < 2 or not all(isinstance(a, fx.Node) for a in args):
        return None
    return args[0], args[1]


def add_alpha(node: fx.Node):
    """``alpha`` of ``torch.add(a, b, alpha=alpha)`` (``a + alpha * b``): 1 unless given."""
    return node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)


# Attributes of a tensor that are its values (transposes, parts): ``getattr(k, "mT")`` carries data.
VALUE_ATTRIBUTES = {"T", "mT", "H", "mH", "real", "imag", "data"}


def is_shape_query(node: fx.Node) -> bool:
    """Reads only a tensor's metadata (shape, dtype, device): not a data dependency."""
    if op_name(node) == "getattr" and len(node.args) > 1 and node.args[1] in VALUE_ATTRIBUTES:
        return False
    return op_name(node) in SHAPE_OPS or op_name(node) in LIKE_OPS


def is_size_value(node: fx.Node) -> bool:
    """A size read off a tensor: ``x.size(-1)``, ``sym_size``, ``x.shape[2]``, ``x.shape``."""
    if op_name(node) in SHAPE_OPS:
        return is_shape_query(node)
    return op_name(node) == "getitem" and isinstance(node.args[0], fx.Node) and is_size_value(node.args[0])


def shape_of(node: fx.Node) -> tuple | None:
    """The shape the capture recorded for ``node`` (Dynamo and torch.export record one; fx does not)."""
    for key in ("val", "example_value", "tensor_meta"):
        shape = getattr(node.meta.get(key), "shape", None)
        if shape is not None:
            return tuple(shape)
    return None


def is_inactive_dropout(node: fx.Node, gm: fx.GraphModule) -> bool:
    """A dropout that is the identity: eval-mode module, ``training=False`` or ``p == 0``."""
    module = submodule(gm, node)
    if module is not None:
        return isinstance(module, compat.DropoutBase) and (not module.training or module.p == 0)
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


def is_dropout(node: fx.Node, gm: fx.GraphModule) -> bool:
    module = submodule(gm, node)
    if module is not None:
        return isinstance(module, compat.DropoutBase)
    return op_name(node) in DROPOUT_OPS


def is_reshape(node: fx.Node) -> bool:
    """Reorganises leading dimensions only: the last (feature) dimension and the order of the elements
    are kept (``h.reshape(-1, d)``, ``h.view(b, t, d)``, ``flatten(0, 1)``, ``unflatten(0, (b, t))``).

    With recorded shapes (Dynamo, torch.export) the last dimensions are compared; an fx graph records
    none, so there the size arguments must say it: the last one a size read off a tensor or a constant
    other than -1, a flatten that ends before the last dimension, an (un)squeeze or unflatten elsewhere.
    """
    name = op_name(node)
    if name not in RESHAPE_OPS or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    before, after = shape_of(node.args[0]), shape_of(node)
    if before is not None and after is not None:
        return bool(before) and bool(after) and str(before[-1]) == str(after[-1])
    if name in ("view_as", "reshape_as"):
        return True
    if name == "flatten":
        end = node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1)
        return isinstance(end, int) and end >= 0
    if name in ("unflatten", "squeeze", "unsqueeze"):
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        return isinstance(dim, int) and dim != -1
    sizes = node.args[1:] if len(node.args) > 2 else node.kwargs.get("shape", node.args[1:2])
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
        sizes = sizes[0]
    if not sizes:
        return False
    last = sizes[-1]
    if isinstance(last, fx.Node):
        return is_size_value(last) and (len(sizes) > 1 or op_name(last) in SHAPE_OPS)
    return isinstance(last, int) and last != -1


CLAMP_OPS = {"clamp", "clip"}


def is_self_bounded_clamp(node: fx.Node) -> bool:
    """``clamp(h, min, max)`` whose bounds are constants (or module attributes) or computed from ``h``
    and those alone: a saturation of
    the stream, T5's fp16 guard ``clamp(h, -c, c)`` with ``c = where(isinf(h).any(), max - 1000, max)``.
    Applied to an aggregate, its bounds (reading the stream value) read the aggregate too."""
    if op_name(node) not in CLAMP_OPS or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    source = node.args[0]
    bounds = [b for b in (*node.args[1:], *node.kwargs.values()) if isinstance(b, fx.Node)]
    return all(_computed_only_from(bound, source, depth=8) for bound in bounds)


def _computed_only_from(node: fx.Node, source: fx.Node, depth: int) -> bool:
    if node is source:
        return True
    inputs = node.all_input_nodes
    if node.op == "get_attr":                   # a constant or parameter of the module
        return True
    if node.op == "placeholder" or depth == 0 or not inputs:
        return node.op == "call_function" and not inputs      # a constant made in the graph (full, tensor)
    return all(_computed_only_from(i, source, depth - 1) for i in inputs)


def writes_first_argument(node: fx.Node) -> bool:
    """Whether ``node`` changes its first argument in place (``x.add_(v)``, ``x += v``, an aten op whose
    schema writes its first argument)."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op != "call_function":
        return False
    if node.target in IN_PLACE_OPERATORS:
        return True
    if isinstance(node.target, compat.OpOverload):
        arguments = node.target._schema.arguments
        alias = arguments[0].alias_info if arguments else None
        return alias is not None and alias.is_write
    return False


def in_place_edit_error(user: fx.Node) -> UnsupportedArchitectureError:
    """The refusal of ``user``, an op that changes the residual stream in place between two residual sites."""
    path = provenance.owner_path(user)
    return UnsupportedArchitectureError(
        f"{op_name(user)} changes the residual stream in place between two residual sites"
        f"{f' in {path}' if path else ''} (a forward hook that edits a layer's output, out.add_(v), does), "
        "which a graph of the whole call cannot hand on to the AttnRes sources. The layer route takes "
        "such an edit of a layer's output into the stream's partial sum: convert with route='layer' "
        "(or the default 'auto').")


def is_stream_op(node: fx.Node, gm: fx.GraphModule) -> bool:
    """What the residual stream may pass through between two sites and stay the same stream: identities
    on values, dropout (in either mode), reshapes of the leading dimensions and clamps bounded by the
    stream itself. The rewrite applies the same ops to the aggregate a site reads."""
    return is_transparent(node, gm) or is_dropout(node, gm) or is_reshape(node) or is_self_bounded_clamp(node)


def is_norm_module(module: nn.Module | None) -> bool:
    return isinstance(module, NORM_MODULES)


def is_norm_op(node: fx.Node, gm: fx.GraphModule) -> bool:
    """A single normalisation op: a norm module call or a functional / aten norm."""
    module = submodule(gm, node)
    if module is not None:
        return is_norm_module(module)
    return op_name(node) in NORM_OPS


def is_parameterised_compute(node: fx.Node, gm: fx.GraphModule, param_derived: set[fx.Node]) -> bool:
    """A Linear / matmul / conv with learned weights: what makes an add's operand a *branch*."""
    module = submodule(gm, node)
    if module is not None:
        has_params = any(True for _ in module.parameters())
        return has_params and not is_norm_module(module) and not isinstance(module, nn.Embedding)
    if is_custom_op(node):
        # An opaque layer (an inference engine's GEMM on a packed weight): one that reads the model's state.
        return any(i in param_derived or compat.dynamo_module_state(i) for i in node.all_input_nodes)
    if op_name(node) not in MATMUL_OPS and op_name(node) not in FUSED_LAYER_OPS:
        return False
    return any(i in param_derived for i in node.all_input_nodes)


# Operator namespaces of torch itself; any other is a library's custom operator.
TORCH_NAMESPACES = {"aten", "prims", "_c10d_functional", "c10d_functional", "higher_order"}


def is_custom_op(node: fx.Node) -> bool:
    """A call of an operator another library registered (``torch.ops.<namespace>.<op>``), opaque to torch."""
    target = node.target if node.op == "call_function" else None
    if isinstance(target, compat.OpOverload):
        return target.namespace not in TORCH_NAMESPACES
    if isinstance(target, compat.OpOverloadPacket):
        return target._qualified_op_name.split("::")[0] not in TORCH_NAMESPACES
    return False


def is_attention_op(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Attention as one op or module (SDPA, flex attention, ``nn.MultiheadAttention``)."""
    module = submodule(gm, node)
    if module is not None:
        return isinstance(module, ATTENTION_MODULES)
    return op_name(node) in ATTENTION_OPS


def is_activation_product(node: fx.Node, param_derived: set[fx.Node]) -> bool:
    """A matmul of two activations (no learned weight among its operands): ``q @ k^T``, ``p @ v``,
    a linear-attention state ``k^T v``. Such products are how values at different positions meet."""
    if op_name(node) not in MATMUL_OPS or op_name(node) in CONV_OPS:
        return False
    operands = [i for i in node.all_input_nodes if not is_size_value(i)]
    return len(operands) >= 2 and not any(i in param_derived for i in operands)


def is_scan(node: fx.Node, gm: fx.GraphModule) -> bool:
    """A cumulative op, a scan, or a convolution wider than one position (a causal conv over time)."""
    if op_name(node) in SCAN_OPS:
        return True
    module = submodule(gm, node)
    if isinstance(module, compat.ConvBase):
        return any(k > 1 for k in module.kernel_size)
    if op_name(node) in CONV_OPS and len(node.args) > 1 and isinstance(node.args[1], fx.Node):
        kernel = shape_of(node.args[1])
        return kernel is not None and any(str(k) != "1" for k in kernel[2:])
    return False


def is_routing(node: fx.Node) -> bool:
    return op_name(node) in ROUTING_OPS


def is_softmax(node: fx.Node) -> bool:
    return op_name(node) in SOFTMAX_OPS


def position_index(node: fx.Node) -> tuple[fx.Node, int, object] | None:
    """``(tensor, dim, index)`` for a node that takes one position of a non-last dimension of a tensor
    (``x[:, t]``, ``x.select(1, t)``): the step of a loop over positions. None otherwise."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    tensor = node.args[0]
    name = op_name(node)
    if name == "select" and len(node.args) >= 3:
        dim, index = node.args[1], node.args[2]
    elif name == "getitem" and isinstance(node.args[1], tuple):
        items = node.args[1]
        ints = [k for k, item in enumerate(items) if isinstance(item, int)]
        if len(ints) != 1 or Ellipsis in items[:ints[0]]:
            return None
        dim, index = ints[0], items[ints[0]]
    else:
        return None
    shape = shape_of(tensor)
    if not isinstance(dim, int) or dim == -1 or (shape and dim % len(shape) == len(shape) - 1):
        return None
    while op_name(tensor) in ("slice", "alias") and isinstance(tensor.args[0], fx.Node):
        tensor = tensor.args[0]         # ``x[:, t]`` in torch.export: select(slice(x, 0), 1, t)
    return tensor, dim, index


def is_activation(node: fx.Node, gm: fx.GraphModule) -> bool:
    module = submodule(gm, node)
    if module is not None:
        return isinstance(module, ACTIVATION_MODULES)
    return op_name(node) in ACTIVATION_OPS
