"""Failures of a routed call leave nothing behind: a block trace that fails for a moment is traced again
at the next call (not kept as the kind's failure), and an interrupt at any point of a block's torch.fx
trace (inside torch.fx's own revert of its patches included) leaves no module of the process patched,
no torch function mode pushed and no flag set; the next call computes what it should.

Interrupts are raised where a ``KeyboardInterrupt`` can land: at line events of the Python code that
runs (``sys.settrace``), at points drawn with a fixed seed among the trace's line events and among
those of torch.fx's revert of its patches.
"""

from __future__ import annotations

import copy
import math
import random
import sys

import pytest
import torch
from torch import nn

import attnres_fx
from attnres_fx.checks import relative_error
from attnres_fx.conversion import conversion_of
from attnres_fx.models import TinyTransformer, example_ids
from toy_models import LayerStack

TOL = 1e-5


def tiny():
    torch.manual_seed(0)
    return TinyTransformer(dim=32, num_layers=2, num_heads=4).eval()


def close(a, b, tol=TOL):
    assert a.shape == b.shape and relative_error(a, b) < tol, relative_error(a, b)


# -- a trace failing for a moment -------------------------------------------------------------------------

class Flaky(nn.Module):
    """A block whose code raises once when told to (a transient failure: a resource not ready)."""

    fail_next = False

    def __init__(self, dim=32):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, x):
        if Flaky.fail_next:
            Flaky.fail_next = False
            raise RuntimeError("not ready yet")
        return x + self.mlp(self.norm(x))


def test_a_trace_that_fails_for_a_moment_is_made_again_at_the_next_call():
    torch.manual_seed(0)
    original = LayerStack([Flaky() for _ in range(3)]).eval()
    ids = torch.randint(0, 64, (2, 5))
    model = attnres_fx.attnresify(copy.deepcopy(original), (ids,), preserve_scale=True)
    retrace(model)                         # the conversion's trial traced the blocks: the first call traces
    stats = conversion_of(model).stats
    traces = stats.traces
    with torch.no_grad():
        Flaky.fail_next = True             # the first block's trace fails; that call runs on TorchDynamo
        close(model(ids), original(ids))
        assert stats.captures >= 1
        close(model(ids), original(ids))
        assert stats.traces == traces + 1 and len(conversion_of(model).traces) == 1, "traced once the failure passed"
        captures = stats.captures
        close(model(ids), original(ids))
        assert stats.captures == captures, "the block graphs run, not TorchDynamo"


class Measured(nn.Module):
    """A block whose code torch.fx cannot trace for a reason that is no refusal of control flow (``len`` of
    a traced shape raises a RuntimeError): the same at every trace."""

    def __init__(self, dim=32):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.mlp(self.norm(x)) / len(x.shape)


def test_a_trace_that_fails_twice_is_kept_and_the_calls_settle_on_dynamo(monkeypatch):
    from attnres_fx.routing import graphs

    torch.manual_seed(0)
    original = LayerStack([Flaky() for _ in range(3)]).eval()
    original.layers = nn.ModuleList(Measured() for _ in range(3))
    ids = torch.randint(0, 64, (2, 5))
    attempts = []
    traced = graphs.routable_trace
    monkeypatch.setattr(graphs, "routable_trace", lambda *args: attempts.append(1) or traced(*args))
    # The conversion's trial makes the first attempt, the first call the second.
    model = attnres_fx.attnresify(copy.deepcopy(original), (ids,), preserve_scale=True)
    with torch.no_grad():
        for _ in range(4):
            close(model(ids), original(ids))
    assert len(attempts) == 2, "traced again once after the first failure, then no more"


# -- interrupts ---------------------------------------------------------------------------------------------

class Interrupt:
    """A ``sys.settrace`` function that raises ``KeyboardInterrupt`` at the ``at``-th line event of the
    code a block trace runs (torch.fx, attnres_fx; ``at=None``: counts them, and records torch.fx's revert
    lines)."""

    WATCHED = ("/torch/fx/", "/attnres_fx/")

    def __init__(self, at: int | None = None):
        self.at = at
        self.count = 0
        self.revert_lines: list[int] = []

    def __call__(self, frame, event, arg):
        # torch.fx's scan of every module's globals for math functions is thousands of lines of one loop:
        # left out, to keep the count of points small.
        watched = any(part in frame.f_code.co_filename for part in self.WATCHED)
        return self.line if watched and frame.f_code.co_name != "_autowrap_check" else None

    def line(self, frame, event, arg):
        if event != "line":
            return self.line
        self.count += 1
        if frame.f_code.co_name in ("__exit__", "revert_all_patches", "revert", "_new_patcher") and \
                "torch/fx/_symbolic_trace.py" in frame.f_code.co_filename:
            self.revert_lines.append(self.count)
        if self.count == self.at:
            raise KeyboardInterrupt(f"line event {self.at}")
        return self.line


def retrace(model):
    """Make the next call trace its blocks again (a router's reset keeps its routes: they serve every
    compiler)."""
    conversion_of(model).traces.clear()
    for router in attnres_fx.routing.routers(model):
        router.reset()
        router._shapes.clear()


def call_under(model, ids, interrupt: Interrupt):
    previous = sys.gettrace()      # a tracer running the suite (coverage's) gets its function back
    sys.settrace(interrupt)
    try:
        with torch.no_grad():
            model(ids)
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(previous)


def nothing_left_behind():
    from torch.fx import _symbolic_trace

    assert nn.Module.__dict__["__call__"] is _symbolic_trace._orig_module_call, "nn.Module.__call__ patched"
    assert nn.Module.__dict__["__getattr__"] is _symbolic_trace._orig_module_getattr, "nn.Module.__getattr__ patched"
    assert not any(hasattr(value, "__wrapped__") for value in vars(math).values() if callable(value)), "math patched"
    assert _symbolic_trace.CURRENT_PATCHER is None and not _symbolic_trace.is_fx_tracing()
    assert torch._C._len_torch_function_stack() == 0, "a torch function mode left pushed"


@pytest.mark.slow
def test_an_interrupt_anywhere_in_a_block_trace_leaves_nothing_behind():
    original = tiny()
    ids = example_ids(original.config)
    model = attnres_fx.attnresify(copy.deepcopy(original), preserve_scale=True)
    with torch.no_grad():
        want = original(ids)
    retrace(model)
    counting = Interrupt()
    call_under(model, ids, counting)
    assert counting.revert_lines, "torch.fx reverted its patches in the watched call"
    draw = random.Random(0)
    points = sorted({*draw.sample(range(1, counting.count + 1), 16), *draw.sample(counting.revert_lines, 16)})
    for at in points:
        retrace(model)
        call_under(model, ids, Interrupt(at))
        nothing_left_behind()
        with torch.no_grad():
            close(model(ids), want)
            close(original(ids), want)
