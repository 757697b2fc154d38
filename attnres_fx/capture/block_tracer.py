"""Capture of one block call with its sublayers as calls: the graph the layer route runs.

A block (a transformer layer) performs residual sites; its sublayers (attention, MLP, norms) do not.
:func:`trace_block` traces the block's own forward with ``torch.fx`` and keeps every child module a
*leaf* (one ``call_module`` node, run as the module itself at call time) except the ones named in
``opened``: the children whose forwards hold part of the residual stream (a sublayer that adds its own
residual, Bloom's and T5's), which the caller finds by data flow in a full capture. The result is a
small graph whose nodes are the block's own code and its sublayer calls, so:

- the graph does not depend on what happens inside a sublayer: a KV cache updated at the layer's index,
  a data-dependent expert loop, an attention kernel's Python, another library's hooks on a sublayer;
- blocks that run the same code with the same call shape share one trace (:class:`CallShape`);
- the graph runs at the speed of the original forward: the same module calls, hooks included.

A call is traced as its *shape*: every tensor, Python number (``int``, ``float``) and object that is not
a plain constant (a cache, a config object) becomes a graph input, and constants (``None``, booleans,
strings, dtypes) are baked in. :func:`call_shape` computes that shape in one walk over the arguments;
two calls with the same shape (and the same train/eval flags) run the same graph. Code that needs a
number's value (``range(n)``, ``if step > 0``) is traced again with the numbers baked in (``baked``),
one graph per value.

Inputs are proxies that answer ``isinstance`` as the value they stand for (a tensor, a cache object),
so that code testing types takes the branch it takes at run time; code that branches on a tensor's
value, dtype or shape cannot be traced (:class:`~attnres_fx.TraceError`; the layer route then
captures that block with TorchDynamo). Random draws that take no traced value (``torch.rand([])``, a
LayerDrop's coin) are graph nodes, drawn at every call: ``torch.fx`` would run them once, at trace time,
and bake the draw in. Tracing patches ``torch.nn.Module.__call__`` for the duration,
as ``torch.fx`` does: other threads' module calls go through the tracer's hook untouched (the tracer
acts only in its own thread), and traces are serialised with TorchDynamo's compilations.
"""

from __future__ import annotations

import enum
import linecache
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx, nn

from .. import compat
from ..errors import TraceError

# Values baked into a traced graph (and part of its call shape) rather than passed to it.
CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
                  torch.memory_format, enum.Enum, type(Ellipsis), slice, range)
BLOCK = "block"         # the traced block, as a submodule of the tracer's root
FINAL = "attnres_final"           # a stream's final aggregation, on a block graph's ``self`` (:class:`Bound`)
# The block's own children on a block graph's ``self`` (:class:`Bound`): where its code reads the AttnRes modules
# the block holds itself.
CHILDREN = "attnres_children"
# Functions that draw random values from their arguments' shapes alone.
RANDOM_DRAWS = frozenset({torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal})


def module_constants(module: nn.Module) -> tuple:
    """``(name, type, value)`` of each of ``module``'s own public attributes a trace of its code would bake in
    (:data:`CONSTANT_TYPES`, hashable), by name; its mode (``training``) aside."""
    return tuple(sorted(((name, type(value), value) for name, value in module.__dict__.items()
                         if not name.startswith("_") and name != "training" and isinstance(value, CONSTANT_TYPES)
                         and _hashable(value)), key=lambda item: item[0]))


class _Tensor:
    """Marks a tensor in a call shape."""

    def __repr__(self) -> str:
        return "Tensor"


TENSOR = _Tensor()
_SIMPLE_CONSTANTS = frozenset({type(None), bool, str})
# Python numbers are graph inputs, not constants: a value that changes at every call (a decoding step's
# ``start_pos``) then reuses one graph. Booleans stay constants (flags that select code).
SCALAR_TYPES = (int, float)


# What a block's traced graph is specialised to: ``(args, kwargs, training)``, the structure of the call
# with tensors as :data:`TENSOR`, Python numbers and other objects as their type and constants as
# ``(type, value)``, and the train/eval flags of the modules whose code the graph holds. A plain tuple:
# it is made and hashed at every call.
CallShape = tuple


def call_shape(args: tuple, kwargs: dict, traced: tuple[nn.Module, ...]) -> tuple[CallShape, list]:
    """The call shape of ``module(*args, **kwargs)`` and its graph inputs (tensors, numbers and objects, in
    order), in one walk; ``traced``: the modules whose own code the graph holds (the block, its opened children)."""
    inputs: list = []
    positional = []
    for value in args:
        kind = type(value)
        if kind is torch.Tensor:                    # the common cases, without a call
            inputs.append(value)
            positional.append(TENSOR)
        elif kind is int or kind is float:          # a decoding step's position
            inputs.append(value)
            positional.append(kind)
        elif value is None:
            positional.append((kind, None))
        else:
            positional.append(_shape_of(value, inputs))
    keywords = []
    for key, value in kwargs.items():
        kind = type(value)
        if kind is torch.Tensor:
            inputs.append(value)
            keywords.append((key, TENSOR))
        elif kind in _SIMPLE_CONSTANTS:
            keywords.append((key, (kind, value)))
        elif kind is int or kind is float:
            inputs.append(value)
            keywords.append((key, kind))
        else:
            keywords.append((key, _shape_of(value, inputs)))
    training = traced[0].training if len(traced) == 1 else tuple(module.training for module in traced)
    return (tuple(positional), tuple(keywords), training), inputs


def _shape_of(value: Any, inputs: list) -> Any:
    kind = type(value)
    if kind is torch.Tensor or kind is nn.Parameter:
        inputs.append(value)
        return TENSOR
    if kind in _SIMPLE_CONSTANTS:
        return kind, value
    if kind is int or kind is float:
        inputs.append(value)
        return kind
    if isinstance(value, torch.Tensor):
        inputs.append(value)
        return TENSOR
    if kind is tuple or kind is list:
        return kind, tuple([_shape_of(item, inputs) for item in value])
    if kind is dict:
        return kind, tuple([(key, _shape_of(item, inputs)) for key, item in value.items()])
    if isinstance(value, CONSTANT_TYPES) and _hashable(value):
        return kind, value
    inputs.append(value)
    return kind


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


@dataclass
class TracedBlock:
    """A block call as a graph: ``graph_module``'s root holds the block as submodule :data:`BLOCK`, its
    placeholders are the call's graph inputs in :func:`call_shape` order, and its output is the
    block's result as one value (a tensor, or the tuple / dict it returns). ``opened``: the children
    traced through (paths relative to the block). ``result_type``: the dict subclass the block returns
    (a ``ModelOutput``), which the graph returns as a plain dict; ``None`` for any other result."""

    graph_module: fx.GraphModule
    shape: CallShape
    opened: frozenset[str]
    result_type: type | None = None

    def result(self, value: Any) -> Any:
        """The graph's result as the block returns it."""
        return value if self.result_type is None else self.result_type(value)


def trace_block(block: nn.Module, forward: Callable, args: tuple, kwargs: dict, opened: frozenset[str],
                shape: CallShape, baked: bool = False) -> TracedBlock:
    """Trace ``forward(block, *args, **kwargs)`` (the block's own forward, unbound) with every child
    module but ``opened`` as a leaf; see the module docstring. ``baked``: the call's Python numbers are
    constants of the graph (it still takes them, and ignores them), for code that needs their values
    (``range(n)``, ``if step > 0``). Raises :class:`~attnres_fx.TraceError`
    when the block's code cannot be traced this way."""
    root = nn.Module()
    root.add_module(BLOCK, block)
    tracer = _BlockTracer(frozenset(f"{BLOCK}.{path}" for path in opened))
    names: list[str] = []
    values: list = []
    for index, value in enumerate(args):
        _inputs(value, f"arg{index}", names, values)
    for key, value in kwargs.items():
        _inputs(value, str(key), names, values)

    result_types: list[type] = []

    def call(self, *proxies):
        supply = iter(proxies)
        call_args = tuple(_rebuilt(value, supply, baked) for value in args)
        call_kwargs = {key: _rebuilt(value, supply, baked) for key, value in kwargs.items()}
        result = forward(getattr(self, BLOCK), *call_args, **call_kwargs)
        if isinstance(result, dict) and type(result) is not dict:
            # fx returns any dict as a plain one: the type is put back on each call.
            result_types.append(type(result))
            return dict(result)
        return result

    # fx reads the traced function's signature: one named parameter per graph input.
    parameters = ", ".join(["self", *names])
    namespace = {"call": call}
    exec(f"def forward({parameters}):\n    return call({parameters})\n", namespace)  # noqa: S102 - names are ours
    traced_class = type(f"{type(block).__name__}Call", (nn.Module,), {"forward": namespace["forward"]})
    root.__class__ = traced_class
    tracer.value_types = [type(value) for value in values]
    # The globals of the code the trace runs, where torch.fx may patch math functions (autowrap).
    code_globals = {id(g): g for g in (getattr(getattr(m, "forward", m), "__globals__", None)
                                        for m in block.modules()) if g is not None}
    try:
        with compat.dynamo_compile_lock(), compat.fx_trace_undone(tuple(code_globals.values())), \
                _RandomDrawsAsNodes(tracer):
            graph = tracer.trace(root)
    except TraceError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of the trace is reported the same way
        raise TraceError(f"{type(block).__name__} cannot be traced with its sublayers as calls: "
                         f"{type(err).__name__}: {err}", {"fx": err}) from err
    root.__class__ = nn.Module
    _relative_module_stacks(graph)
    return TracedBlock(fx.GraphModule(root, graph, class_name=f"{type(block).__name__}Graph"), shape, opened,
                       result_types[0] if result_types else None)


def module_graph(module: nn.Module) -> fx.Graph:
    """The graph of ``module``'s own forward on one tensor, its children as leaves and its own parameters read
    by ``get_attr`` of their names: traced as a block is (in this thread only, torch.fx's patches undone
    however it ends). What :mod:`attnres_fx.passes.fuse_norms` matches a norm module on. Raises
    :class:`~attnres_fx.TraceError`."""
    graph = trace_block(module, type(module).forward, (torch.empty(0),), {}, frozenset(), None).graph_module.graph
    prefix = BLOCK + "."
    for node in graph.find_nodes(op="get_attr"):
        node.target = node.target[len(prefix):] if node.target.startswith(prefix) else node.target
    return graph


def _inputs(value: Any, name: str, names: list[str], values: list) -> None:
    kind = type(value)
    if kind is tuple or kind is list:
        for index, item in enumerate(value):
            _inputs(item, f"{name}_{index}", names, values)
    elif kind is dict:
        for key, item in value.items():
            _inputs(item, f"{name}_{key}", names, values)
    elif _is_input(value):
        names.append(_identifier(name, names))
        values.append(value)


def _is_input(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) or type(value) in SCALAR_TYPES
            or not (isinstance(value, CONSTANT_TYPES) and _hashable(value)))


def _identifier(name: str, taken: list[str]) -> str:
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    if not name or name[0].isdigit():
        name = f"_{name}"
    candidate, suffix = name, 1
    while candidate in taken or candidate == "self":
        candidate, suffix = f"{name}_{suffix}", suffix + 1
    return candidate


def _rebuilt(value: Any, supply, baked: bool) -> Any:
    kind = type(value)
    if kind is tuple or kind is list:
        return kind(_rebuilt(item, supply, baked) for item in value)
    if kind is dict:
        return {key: _rebuilt(item, supply, baked) for key, item in value.items()}
    if kind in SCALAR_TYPES:
        proxy = next(supply)
        return value if baked else proxy
    if _is_input(value):
        return next(supply)
    return value


class _InputProxy(fx.Proxy):
    """A graph input that answers ``isinstance`` (through ``__class__``) as the value it stands for."""

    value_type: type = torch.Tensor

    @property
    def __class__(self):  # noqa: D105 - isinstance() falls back to __class__
        return self.value_type


class _BlockTracer(fx.Tracer):
    """Leaves every module but the block and ``opened``; acts only in the thread that traces."""

    def __init__(self, opened: frozenset[str]):
        super().__init__(autowrap_modules=(math,), param_shapes_constant=False)
        self.opened = opened
        self.thread = threading.get_ident()
        self.value_types: list[type] = []
        self._placeholders = 0

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name != BLOCK and module_qualified_name not in self.opened

    def call_module(self, m, forward, args, kwargs):
        if threading.get_ident() != self.thread:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if threading.get_ident() != self.thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        if node.op != "placeholder":
            return super().proxy(node)
        proxy = _InputProxy(node, self)
        value_type = self.value_types[self._placeholders]
        self._placeholders += 1
        # Tensors stand as torch.Tensor (a Parameter check must fail), other objects as their class.
        proxy.__dict__["value_type"] = torch.Tensor if issubclass(value_type, torch.Tensor) else value_type
        return proxy

    def create_arg(self, a: Any):
        if isinstance(a, fx.Proxy):
            return a.node
        return super().create_arg(a)


class _RandomDrawsAsNodes(torch.overrides.TorchFunctionMode):
    """Records the random draws of the tracer's thread that take no traced value as graph nodes."""

    def __init__(self, tracer: _BlockTracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in RANDOM_DRAWS and threading.get_ident() == self.tracer.thread and not any(
                isinstance(value, fx.Proxy) for value in (*args, *kwargs.values())):
            return self.tracer.create_proxy("call_function", func, args, kwargs)
        return func(*args, **kwargs)


def _relative_module_stacks(graph: fx.Graph) -> None:
    """Module paths in ``nn_module_stack`` relative to the block (``self_attn``, not ``block.self_attn``):
    what detection and the plan read. ``call_module`` targets keep the root's paths."""
    prefix = BLOCK + "."
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {key: (path[len(prefix):] if path.startswith(prefix) else path, cls)
                                            for key, (path, cls) in stack.items()}


def called_child(node: fx.Node) -> str | None:
    """The name of the block's child that ``node`` calls directly (target ``block.attention``), else
    ``None`` (a path below a child, ``block.attn.q_proj``, is a read through the block)."""
    if node.op != "call_module":
        return None
    holder, _, name = node.target.partition(".")
    return name if holder == BLOCK and name and "." not in name else None


def children_read(graph: fx.Graph) -> tuple[str, ...]:
    """The names of the block's children that the code :func:`compiled_forward` makes of ``graph`` reads
    through :data:`CHILDREN`: the AttnRes modules the block holds, and the children it calls directly."""
    names = []
    for node in graph.nodes:
        if node.op == "get_attr":
            holder, _, name = node.target.partition(".")
            name = name if holder == CHILDREN and "." not in name else None
        else:
            name = called_child(node)
        if name:
            names.append(name)
    return tuple(dict.fromkeys(names))


def compiled_forward(graph: fx.Graph, name: str) -> Callable:
    """``forward(root, *inputs)`` from ``graph``'s code, resolving ``self.<target>`` on whatever ``root``
    it is given at call time (a :class:`Bound`): the module tree as it is then, not a copy of it. The
    children the block calls directly are read through :data:`CHILDREN` (:func:`children_read`): a dict
    look-up where ``block.<name>`` would reach ``nn.Module.__getattr__`` only after CPython has raised
    and formatted an AttributeError, about a microsecond per call of a child."""
    calls = {node: node.target for node in graph.find_nodes(op="call_module") if called_child(node)}
    try:
        # The graph is left as it is (its targets are the graph module's paths): renamed for the code only.
        for node in calls:
            node.target = f"{CHILDREN}.{called_child(node)}"
        code = graph.python_code(root_module="self")
    finally:
        for node, target in calls.items():
            node.target = target
    filename = f"<attnres_fx {name}>"
    linecache.cache[filename] = (len(code.src), None, code.src.splitlines(keepends=True), filename)
    namespace = dict(code.globals)
    exec(compile(code.src, filename, "exec"), namespace)  # noqa: S102 - fx-generated code
    return namespace["forward"]


class Bound:
    """The ``self`` a block graph's code runs with: the block at :data:`BLOCK`, the children its code reads
    at :data:`CHILDREN` (``children``: their names, :func:`children_read`), what else the graph refers to
    (tensor constants), and a stream's final aggregation at :data:`FINAL`, looked up at every call in
    ``final`` (its parent module and its name there): the module there then."""

    def __init__(self, block: nn.Module, final: tuple[nn.Module, str] | None = None, children: tuple[str, ...] = (),
                 **others: Any):
        setattr(self, BLOCK, block)
        # Where the block does not hold them itself (a wrapper that forwards attribute reads to the layer it
        # holds), they are read through the block.
        setattr(self, CHILDREN, _Children(block._modules) if all(name in block._modules for name in children)
                else block)
        self._final = final
        for name, value in others.items():
            setattr(self, name, value)

    @property
    def attnres_final(self) -> nn.Module:
        parent, name = self._final
        return parent._modules[name]


class _Children:
    """A module's children (its ``_modules``, the dict itself: a module put in a child's place later is found)
    as attributes, read by a dict look-up: ``nn.Module.__getattr__``, which a child's name reaches, runs only
    after CPython has raised and formatted an AttributeError, some microseconds a block call."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.__dict__ = modules

