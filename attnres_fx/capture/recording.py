"""The conversion's capture: one call of the model, run for real, recorded op by op into a graph.

A conversion needs the model's data flow once, to find its residual streams and plan them; the calls
that follow run their own graphs (:mod:`attnres_fx.routing`). :func:`record_graph` runs the model on the
example inputs with a ``TorchFunctionMode`` that appends every torch-level op to an ``fx.Graph`` (its
tensor inputs as the nodes that made them, the model's parameters and buffers as ``get_attr``, the
call's tensors as placeholders), and forward hooks that give each node the module stack it ran in
(``nn_module_stack``, as torch.fx and TorchDynamo record it). Each node carries a meta-device copy of
its value (``example_value``) for the shapes detection reads.

So the graph is the one TorchDynamo would capture for this call, without its symbolic execution: it
costs an eager call of the model at the example size (milliseconds per layer on the meta device or
the CPU), it follows whatever Python the model runs (a warning, a data-dependent branch, an expert loop
over the experts this call routes to, a cache utility), and it specialises on the call as a trace on
concrete values does. Nothing of the model changes: no gradients, the random state and every buffer are
restored afterwards.

A tensor the recorder did not see made (an op outside torch's Python API) would cut the data flow:
:func:`record_graph` then raises :class:`~attnres_fx.TraceError`, and the caller captures with
TorchDynamo instead.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from typing import Any

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode

from ..compat import pytree
from ..errors import TraceError

# Tensor dunders as the operators TorchDynamo and torch.fx record (``x + y`` is ``operator.add``);
# ``reversed``: the tensor is the right operand.
_OPERATORS = {name: (getattr(operator, op), False) for name, op in (
    ("__add__", "add"), ("__sub__", "sub"), ("__mul__", "mul"), ("__truediv__", "truediv"),
    ("__floordiv__", "floordiv"), ("__mod__", "mod"), ("__pow__", "pow"), ("__matmul__", "matmul"),
    ("__and__", "and_"), ("__or__", "or_"), ("__xor__", "xor"), ("__neg__", "neg"), ("__invert__", "invert"),
    ("__getitem__", "getitem"), ("__setitem__", "setitem"), ("__iadd__", "iadd"), ("__isub__", "isub"),
    ("__imul__", "imul"), ("__itruediv__", "itruediv"), ("__lt__", "lt"), ("__le__", "le"), ("__gt__", "gt"),
    ("__ge__", "ge"), ("__eq__", "eq"), ("__ne__", "ne"))}
_OPERATORS.update({name: (getattr(operator, op), True) for name, op in (
    ("__radd__", "add"), ("__rsub__", "sub"), ("__rmul__", "mul"), ("__rtruediv__", "truediv"),
    ("__rpow__", "pow"), ("__rmatmul__", "matmul"))})


# Python's number types where torch takes a dtype (``torch.zeros(n, dtype=int)``, as transformers' chunked
# attention masks are made): the dtypes torch reads them as. A graph's code cannot spell the types.
_PYTHON_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


# ``graph_module.meta[MODULE_CALLS]``: each module's first call in the recording, ``{path: (args, kwargs)}``.
MODULE_CALLS = "attnres_module_calls"


def record_graph(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """The graph of ``model(*args, **kwargs)``, recorded as it runs; see the module docstring. Its
    ``meta[MODULE_CALLS]`` holds the inputs each module was first called with."""
    recorder = _Recorder(model)
    handles = []
    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(
            lambda m, a, k, path=path: recorder.enter(path, type(m), a, k), with_kwargs=True))
        handles.append(module.register_forward_hook(lambda m, a, out: recorder.leave(), always_call=True))
    try:
        inputs = recorder.placeholders((args, kwargs))
        with _state_kept(model), recorder:
            # The class's forward, as TorchDynamo captures it: not a wrapper another library set on the
            # instance, not the root's own hooks.
            output = type(model).forward(model, *inputs[0], **inputs[1])
    except TraceError:
        raise
    except Exception as err:  # noqa: BLE001 - the model's own failure, reported as such
        raise TraceError(f"{type(model).__name__} fails on the example inputs as they are given: "
                         f"{type(err).__name__}: {err}\nPass example inputs that make a valid call of the model "
                         "(positional as example_inputs, keyword as example_kwargs).", {"model": err}) from err
    finally:
        for handle in handles:
            handle.remove()
    recorder.graph.output(recorder.argument(_plain(output)))
    graph_module = fx.GraphModule(model, recorder.graph, class_name=type(model).__name__)
    graph_module.meta[MODULE_CALLS] = recorder.calls
    return graph_module


def record_calls(model: nn.Module, args: tuple, kwargs: dict, paths) -> dict[str, tuple[tuple, dict]]:
    """The first call of each module at ``paths`` in ``model(*args, **kwargs)``, run for real (its hooks
    included, as a user's call runs), ``{path: (args, kwargs)}``; the model's state is left as it was, as
    by :func:`record_graph`. A failure of the call is the model's own: raised as it is."""
    calls: dict[str, tuple[tuple, dict]] = {}

    def recorder(path: str):
        def record(module, args, kwargs):
            calls.setdefault(path, (args, kwargs))
        return record
    handles = [model.get_submodule(path).register_forward_pre_hook(recorder(path), with_kwargs=True)
               for path in paths]
    try:
        with _state_kept(model):
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return calls


@contextlib.contextmanager
def _state_kept(model: nn.Module):
    """Within: no gradients recorded; afterwards the random state and every buffer (a batch norm's
    running statistics) are as before."""
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    # A model on CUDA draws its dropout masks from the CUDA generators: those are kept too.
    cuda = sorted({tensor.device.index for tensor in itertools.chain(model.parameters(), model.buffers())
                   if tensor.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            yield
    finally:
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(buffers[name])


def _tensors(value: Any, found: list | None = None) -> list:
    """The tensors in ``value`` (nested tuples, lists and dicts), in order: what an op takes or returns."""
    found = [] if found is None else found
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, found)
    return found


def _plain(output: Any) -> Any:
    """Model outputs (``ModelOutput`` and other dict subclasses) as plain dicts, tuples as tuples."""
    if isinstance(output, dict):
        return {key: _plain(value) for key, value in output.items()}
    if isinstance(output, (tuple, list)) and not hasattr(output, "_fields"):
        return type(output)(_plain(value) for value in output)
    return output


class _Recorder(TorchFunctionMode):
    """Appends every torch-level op with a tensor among its inputs or results to :attr:`graph`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.graph = fx.Graph()
        self.values: dict[int, fx.Node] = {}
        self.alive: list = []                  # keeps every recorded tensor alive: ids stay unique
        self.stack: list[tuple[str, type]] = []
        self.calls: dict[str, tuple[tuple, dict]] = {}
        self.named = {id(t): name for name, t in model.named_parameters(remove_duplicate=False)}
        self.named.update({id(t): name for name, t in model.named_buffers(remove_duplicate=False)})
        for path, module in model.named_modules():
            for name, value in module.__dict__.items():
                if isinstance(value, torch.Tensor) and id(value) not in self.named:
                    self.named[id(value)] = f"{path}.{name}" if path else name

    def enter(self, path: str, cls: type, args: tuple, kwargs: dict) -> None:
        self.stack.append((path, cls))
        self.calls.setdefault(path, (args, kwargs))

    def leave(self) -> None:
        self.stack.pop()

    def placeholders(self, tree):
        """The call's inputs with a placeholder node for each tensor."""
        def placeholder(value):
            node = self.graph.placeholder(f"input_{len(self.alive)}")
            self._remember(value, node)
            return value
        return pytree.tree_map_only(torch.Tensor, placeholder, tree)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if _is_metadata(func):
            return result
        inputs = _tensors((args, kwargs))
        outputs = _tensors(result)
        if not inputs and not outputs:
            return result
        name = getattr(func, "__name__", "")
        if any(result is t for t in inputs) and not _writes(name):
            # A no-op that hands its input back (``x.to(x.dtype)``, ``x.contiguous()``): the same value,
            # which other code reads under other names; nothing to record.
            return result
        if name == "__get__":
            # A tensor property with a tensor value (``x.mT``, ``x.data``), as torch.fx records it.
            node = self.graph.call_function(getattr, (self.argument(args[0]), func.__self__.__name__))
        elif name in _OPERATORS:
            target, swapped = _OPERATORS[name]
            node = self.graph.call_function(target, self.argument(tuple(reversed(args)) if swapped else args),
                                            self.argument(kwargs))
        elif getattr(torch.Tensor, name, None) is func:
            # A tensor method, as torch.fx and TorchDynamo record it.
            node = self.graph.call_method(name, self.argument(args), self.argument(kwargs))
        else:
            node = self.graph.call_function(func, self.argument(args), self.argument(kwargs))
        if self.stack:
            node.meta["nn_module_stack"] = {path: (path, cls) for path, cls in self.stack if path}
        self._results(node, result)
        return result

    def argument(self, value: Any) -> Any:
        """``value`` with every tensor replaced by the node that holds it."""
        if isinstance(value, torch.Tensor):
            return self._node_of(value)
        if isinstance(value, (tuple, list)):
            return type(value)(self.argument(item) for item in value) if not hasattr(value, "_fields") \
                else tuple(self.argument(item) for item in value)
        if isinstance(value, dict):
            return {key: self.argument(item) for key, item in value.items()}
        if isinstance(value, type):
            return _PYTHON_DTYPES.get(value, value)
        return value

    def _node_of(self, tensor: torch.Tensor) -> fx.Node:
        node = self.values.get(id(tensor))
        if node is not None:
            return node
        name = self.named.get(id(tensor))
        if name is None:
            raise TraceError(f"a tensor of shape {tuple(tensor.shape)} reached an op without the recorder seeing "
                             "it made (an op outside torch's Python API); the model is captured with TorchDynamo "
                             "instead")
        node = self.graph.get_attr(name)
        self._remember(tensor, node)
        return node

    def _results(self, node: fx.Node, result: Any) -> None:
        if isinstance(result, torch.Tensor):
            self._remember(result, node)
        elif isinstance(result, (tuple, list)):
            for index, item in enumerate(result):
                if isinstance(item, torch.Tensor):
                    self._remember(item, self.graph.call_function(operator.getitem, (node, index)), node.meta)

    def _remember(self, tensor: torch.Tensor, node: fx.Node, meta: dict | None = None) -> None:
        self.values[id(tensor)] = node
        self.alive.append(tensor)
        if meta and "nn_module_stack" in meta:
            node.meta["nn_module_stack"] = meta["nn_module_stack"]
        node.meta["example_value"] = _meta_copy(tensor)


def _meta_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A value with ``tensor``'s shape, dtype and type (a parameter stays one), holding no data."""
    value = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    return nn.Parameter(value, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else value


_METADATA = {"size", "dim", "numel", "shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "is_leaf",
             "data_ptr", "stride", "storage_offset", "element_size", "is_floating_point", "is_complex",
             "is_contiguous", "layout", "names", "grad_fn", "__len__", "__bool__", "item", "tolist", "__repr__",
             "__format__", "__hash__", "__index__", "__int__", "__float__", "get_device", "nbytes", "itemsize",
             "is_sparse", "is_quantized", "is_meta", "is_nested", "untyped_storage", "_version", "__array__"}


def _writes(name: str) -> bool:
    """Whether a tensor method or operator of this name writes into its first argument."""
    return name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__") or (
        name.endswith("_") and not name.startswith("_"))


def _is_metadata(func) -> bool:
    """Whether ``func`` reads or sets what a tensor is rather than computing a new one (a property getter,
    a setter such as ``requires_grad``)."""
    name = getattr(func, "__name__", "")
    if name == "__set__":
        return True
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    return name in _METADATA
