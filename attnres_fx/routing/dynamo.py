"""TorchDynamo where a route needs it: the model route's whole-call graphs, the layer route's blocks whose
own code ``torch.fx`` cannot trace, and under Inductor (:func:`attnres_fx.compile`) the capture of the
layer route's rewritten block graphs.

A routed module's call runs a ``torch.compile``'d entry of its own forward (``fullgraph``), whose backend
rewrites a copy of each graph Dynamo captures. Dynamo captures one graph per call signature, train/eval
mode, dtype and shape class, with guards; a graph break is an error (:class:`~attnres_fx.TraceError`).

What a capture needs of the process is set while Dynamo compiles one of these entries, not around every
call: Dynamo's compilation callbacks apply :func:`attnres_fx.capture.tracers.capture_settings` when the thread
compiling is inside one of attnres_fx's own calls (:func:`own_call`), under Dynamo's compilation lock.
What Dynamo guards on (the ``nn.MultiheadAttention`` fast-path flag, transformers' output collector)
must hold at every call of such an entry: :func:`dynamo_call` sets it.

Inside an attnres_fx capture, a routed module reached by the trace runs its own forward, as written
(:func:`inside_own_capture`, read while tracing and taken as a constant): one graph holds what the
capture covers. The marker is per thread, so a capture in one thread never changes what a call in
another runs.
"""

from __future__ import annotations

import contextlib
from contextlib import ExitStack
from typing import Any, Callable

from .. import compat
from ..capture.tracers import capture_settings, in_own_call, own_call
from ..errors import AttnResError, RoutingError
from ..passes.signature import state_kinds, state_slots
from ..context import call_context

# Dynamo's default is 8 graphs per code object; one converted module can legitimately need more (train
# and eval, two dtypes, prefill and decode, static and dynamic shapes).
RECOMPILE_LIMIT = 64

@compat.assume_constant_result
def inside_own_capture() -> bool:
    """Whether the TorchDynamo trace in progress is one of attnres_fx's own (read while tracing)."""
    return in_own_call()


def _on_compile_start(args) -> None:
    if not compat.is_dynamo_frame_compile(args) or not in_own_call():
        return
    stack = ExitStack()
    stack.enter_context(capture_settings())
    call_context().compile_settings.append(stack)


def _on_compile_end(args) -> None:
    stacks = call_context().compile_settings
    if compat.is_dynamo_frame_compile(args) and stacks:
        stacks.pop().close()


@contextlib.contextmanager
def dynamo_call(checkpointing_flag_holders: tuple = ()):
    """Within: one call of a Dynamo entry of attnres_fx (see the module docstring)."""
    # Registered at each call: torch.compiler.reset() drops the callbacks (and with them the capture settings).
    compat.on_dynamo_compile(_on_compile_start, _on_compile_end)
    with (own_call(), compat.mha_fast_path_off(), compat.output_recorders_traceable(),
          compat.compiling_despite_force_eager(), compat.hf_inner_checkpointing_flags_off(checkpointing_flag_holders),
          compat.nn_module_hook_guards()):
        yield


def block_entry_function(forward: Callable, count: int) -> Callable:
    """``entry(module, state, *args, **kwargs) -> (forward(module, *args, **kwargs), slots)``: a layer-routed
    block's call with the stream's state tensors ``state`` (a list: the completed blocks, then the partial
    sum) as real inputs, and ``count`` state outputs (:func:`~attnres_fx.passes.signature.state_slots`,
    filled by the rewrite): the calling convention of every block graph
    (:mod:`attnres_fx.passes.signature`). A code object of its own, as :func:`entry_function`'s."""
    kinds = state_kinds(count)

    def entry(module, state, *args, **kwargs):
        return forward(module, *args, **kwargs), state_slots(state, kinds)
    entry.__code__ = entry.__code__.replace()
    return entry


def compiled_entry(function: Callable, backend: Callable, compiler: str) -> Callable:
    """``function`` (an entry: :func:`~attnres_fx.capture.tracers.entry_function`, :func:`block_entry_function`)
    compiled by TorchDynamo with ``backend`` (fullgraph). Eager runs gain nothing from static shapes: they
    capture with dynamic ones from the start, so that a new length or batch reuses the graph; Inductor
    specialises first and makes a dimension dynamic once it changes."""
    dynamic = True if compiler == "eager" else None
    return compat.compile_with_recompile_limit(function, RECOMPILE_LIMIT, backend=backend, fullgraph=True,
                                               dynamic=dynamic)


def run(call: Callable[[], Any], as_written: Callable[[], Any], module, graph_break_message: Callable[[Exception], str],
        checkpointing_flag_holders: tuple = ()) -> Any:
    """``call()``, a call of a compiled entry of ``module``; an attnres_fx error raised in the backend is raised
    as itself, a graph break as :class:`~attnres_fx.TraceError` with ``graph_break_message(err)``. Where the
    model's own code raised while Dynamo traced it, the call runs as written (``as_written()``) to raise the
    model's own exception, as itself: the original model raises it too."""
    from ..errors import TraceError

    with dynamo_call(checkpointing_flag_holders):
        try:
            return call()
        except compat.BackendCompilerFailed as err:
            if isinstance(err.inner_exception, AttnResError):
                raise err.inner_exception.with_traceback(None) from err
            raise
        except compat.FailOnRecompileLimitHit as err:
            raise RoutingError(
                f"{type(module).__name__} needs a new graph for this call and has {RECOMPILE_LIMIT} already, the most "
                "attnres_fx captures per module: an argument that is no tensor (a Python float or int) is part of "
                "the graph, so each new value of one makes a new graph. Pass such a value as a tensor "
                "(torch.tensor(value)), or keep to fewer values; calls like the earlier ones run as before.") from err
        except compat.DynamoUnsupported as err:
            if _raised_by_traced_code(err):
                as_written()
            raise TraceError(graph_break_message(err), {"dynamo": err}) from err


def _raised_by_traced_code(err: BaseException) -> bool:
    """Whether a Dynamo failure is the traced code raising an exception (an ``ObservedException``)."""
    while err is not None:
        if isinstance(err, compat.ObservedException):
            return True
        err = err.__cause__ or err.__context__
    return False
