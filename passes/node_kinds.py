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

from torch import fx, nn

from attnres_fx import compat

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


def is_stream_op(node: fx.Node, gm: fx.GraphModule) -> bool:
    """What the residual stream may pass through between two sites and stay the same stream: identities
    on values, dropout (in either mode), reshapes of the leading dimensions and clamps bounded by the
    stream itself. The rewrite applies the same ops to the aggregate a site reads."""
    return is_transparent(node, gm) or is_dropout(node, gm) or is_reshape(node) or is_self_bounded_clamp(node)


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


def mutated_input(node: fx.Node) -> fx.Node | None:
    """The tensor an in-place op writes into: ``y[:, t] = v`` (``setitem``), ``y.copy_(v)``,
    ``y.index_put_(...)``, ``y += v``, ``torch.add(a, b, out=y)``; None for any other node."""
    out = node.kwargs.get("out")
    if isinstance(out, fx.Node):
        return out
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.op == "call_function" and (node.target is operator.setitem or node.target in IN_PLACE_OPERATORS):
        return node.args[0]
    if isinstance(node.target, compat.OpOverload):
        arguments = node.target._schema.arguments
        writes = bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write
        return node.args[0] if writes else None
    name = op_name(node)
    return node.args[0] if name.endswith("_") and not name.startswith("_") and node.op != "call_module" else None


class DataFlow:
    """Which nodes carry values into which, for one graph: the graph's edges, minus metadata reads
    (:func:`data_inputs`), plus the edges in-place writes leave implicit.

    ``y = zeros(b, t, d); for t: y[:, t] = f(x[:, t]); out(y)``: no edge leads from the ``setitem``
    nodes to ``out(y)``, which reads ``y`` itself. Here a node that reads a tensor also reads the latest
    write before it into that tensor or into any view of it (``y[:, t]``, a ``reshape``), so the
    writes, and what they wrote, are its ancestors.
    """

    def __init__(self, graph: fx.Graph):
        self.position = {node: i for i, node in enumerate(graph.nodes)}
        base: dict[fx.Node, fx.Node] = {}
        writes: dict[fx.Node, list[fx.Node]] = {}
        for node in graph.nodes:
            source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
            base[node] = base.get(source, source) if source is not None and op_name(node) in VIEW_OPS else node
            target = mutated_input(node)
            if target is not None:
                writes.setdefault(base.get(target, target), []).append(node)
        self._parents: dict[fx.Node, tuple[fx.Node, ...]] = {}
        self._children: dict[fx.Node, list[fx.Node]] = {node: [] for node in graph.nodes}
        for node in graph.nodes:
            parents = dict.fromkeys(data_inputs(node))
            for value in list(parents):
                latest = _latest_before(writes.get(base.get(value, value), ()), node, self.position)
                if latest is not None:
                    parents[latest] = None
            self._parents[node] = tuple(parents)
            for parent in parents:
                self._children[parent].append(node)

    def parents(self, node: fx.Node) -> tuple[fx.Node, ...]:
        return self._parents[node]

    def children(self, node: fx.Node) -> list[fx.Node]:
        return self._children[node]


def _latest_before(writes, node: fx.Node, position: dict[fx.Node, int]) -> fx.Node | None:
    """The last of ``writes`` (in graph order) that comes before ``node``."""
    latest = None
    for write in writes:
        if position[write] >= position[node]:
            break
        latest = write
    return latest


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
    if op_name(node) not in MATMUL_OPS and op_name(node) not in FUSED_LAYER_OPS:
        return False
    return any(i in param_derived for i in node.all_input_nodes)


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
        if is_stream_op(reader, gm) and reads_normalised(reader, list(reader.users), gm):
            continue
        return False
    return True
