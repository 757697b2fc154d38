"""Contract of the conversion's trial (attnres_fx.routing.trial) with the layer route: the trial prepares each
block through the router the conversion installs, and what it made is what the first call runs.

Structural: after conversion the work counters (``conversion.stats``) hold the trial's traces and rewrites, and
a first call like the conversion's adds none; the graphs the first call runs are the very graphs the trial
made, and the ones a route preparing at its first call makes (no trial) are the same code with the same
signature; a block torch.fx cannot trace is decided for TorchDynamo by the trial, as by the route; a Hugging
Face model's first call with its default arguments (its key/value cache on, which the capture turns off) and
generate() make nothing either, nor a first training step of a model converted in eval mode (the trial
prepares both calls in the other mode too, and leaves every module's flag as it was).
Numerical: the outputs of the two are equal bit for bit (the same code on the same weights).
"""

import copy

import pytest
import torch
from torch import nn

import attnres_fx
from attnres_fx import routing
from attnres_fx.conversion import conversion_of
from attnres_fx.models import TinyTransformer, example_ids
from attnres_fx.passes.signature import SIGNATURE
from attnres_fx.testing import randomise_pseudo_queries
from hf_models import build_hf, hf_example_inputs, needs_hf
from toy_models import DropoutLayer, LayerStack


def tiny(layers=6):
    torch.manual_seed(0)
    return TinyTransformer(dim=32, num_layers=layers, num_heads=4).eval()


def made_by_the_trial(model) -> dict:
    """The rewritten block graphs in the conversion's cache, by id."""
    return {id(found[1]): found[1] for found in conversion_of(model).traces._entries.values()
            if isinstance(found, tuple) and SIGNATURE in found[1].meta}


def test_the_first_call_runs_what_the_trial_made_and_traces_nothing():
    ids = example_ids(tiny().config)
    model = randomise_pseudo_queries(attnres_fx.attnresify(tiny(), (ids,), block_size=4))
    stats = conversion_of(model).stats
    # One trace for the six identical blocks in eval mode and one in train mode; one rewritten graph per place
    # in a stream block for each.
    assert (stats.traces, stats.rewrites, stats.captures) == (2, 8, 0)
    made = made_by_the_trial(model)
    assert len(made) == 8
    with torch.no_grad():
        out = model(ids)
    assert (stats.traces, stats.rewrites, stats.captures) == (2, 8, 0), "the first call made nothing"
    ran = [router.rewritten[-1] for router in routing.routers(model)]
    assert all(id(graph) in made for graph in ran), "the first call runs the trial's graphs"

    # The same route preparing at its first call (no trial): the same decisions, code and signatures.
    fresh = copy.deepcopy(model)          # a copy keeps no graphs: made again at its first call
    fresh_stats = conversion_of(fresh).stats
    counted = (fresh_stats.traces, fresh_stats.rewrites)
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids), out, rtol=0, atol=0)
    assert (fresh_stats.traces - counted[0], fresh_stats.rewrites - counted[1]) == (1, 4)
    for trial_graph, route_graph in zip(ran, [router.rewritten[-1] for router in routing.routers(fresh)]):
        assert route_graph.code == trial_graph.code
    signatures = [graph.meta[SIGNATURE] for graph in ran]
    assert [r.rewritten[-1].meta[SIGNATURE] for r in routing.routers(fresh)] == signatures


def test_a_first_training_step_after_a_conversion_in_eval_mode_traces_nothing():
    """Converted in eval mode, every module's flag is eval again after the conversion and the random state is
    the one before it; then trained: the first training step (dropout on, gradients recorded) runs graphs
    the trial made in train mode, and makes none."""
    torch.manual_seed(0)
    model = LayerStack([DropoutLayer() for _ in range(4)]).eval()
    ids = torch.randint(0, 64, (2, 5))
    state = torch.get_rng_state()
    model = attnres_fx.attnresify(model, (ids,), block_size=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert not any(module.training for module in model.modules())
    stats = conversion_of(model).stats
    made = (stats.traces, stats.rewrites, stats.captures)
    model.train()
    model(ids).float().square().mean().backward()
    assert (stats.traces, stats.rewrites, stats.captures) == made, "the first training step made nothing"


class ByWidth(nn.Module):
    """A block whose code branches on its input's width: torch.fx refuses the trace (control flow on a
    traced value), TorchDynamo takes it (a guard on the shape)."""

    def __init__(self, dim=32):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, x):
        h = self.norm(x)
        if x.shape[-1] > 16:
            h = h * 2
        return x + self.mlp(h)


def test_a_block_fx_cannot_trace_is_decided_for_dynamo_by_the_trial():
    torch.manual_seed(0)
    original = LayerStack([ByWidth() for _ in range(3)]).eval()
    ids = torch.randint(0, 64, (2, 5))
    model = attnres_fx.attnresify(copy.deepcopy(original), (ids,), preserve_scale=True)
    stats = conversion_of(model).stats
    routers = routing.routers(model)
    decided = [[routes.traced for routes in router._shapes.values()] for router in routers]
    assert decided == [[None, None]] * 3, "each block's call shape, in eval and train mode, is kept as TorchDynamo's"
    traces = stats.traces
    with torch.no_grad():
        # preserve_scale at zero init: the original function; fp32 sums in another order, 1e-5.
        torch.testing.assert_close(model(ids), original(ids), rtol=1e-5, atol=1e-5)
    assert stats.traces == traces == 0, "the first call tries no trace"
    assert stats.captures >= 1


@needs_hf
def test_the_first_call_with_the_default_arguments_traces_nothing():
    """The capture's call turns a Hugging Face model's key/value cache off; a call with the model's defaults
    (and generate()) turns it on, so each block receives a cache object: another call shape, prepared by the
    trial too."""
    original = build_hf("llama", use_cache=True, hidden_size=64, head_dim=32, num_hidden_layers=4)
    (ids,), _ = hf_example_inputs("llama", seq=12)
    model = randomise_pseudo_queries(attnres_fx.attnresify(copy.deepcopy(original), (ids,)))
    stats = conversion_of(model).stats
    made = (stats.traces, stats.rewrites, stats.captures)
    assert made[0] == 4, "a trace per kind of block and call shape: the cache off and on, in eval and train mode"
    with torch.no_grad():
        out = model(ids)
    assert out.past_key_values is not None, "the default call used the cache"
    assert (stats.traces, stats.rewrites, stats.captures) == made, "the first default call made nothing"
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    with torch.no_grad():
        model(ids, use_cache=False)
    assert (stats.traces, stats.rewrites, stats.captures) == made, "generate() and the capture's call neither"
    model.train()
    model(ids, labels=ids).loss.backward()
    model(ids, labels=ids, use_cache=False).loss.backward()
    assert (stats.traces, stats.rewrites, stats.captures) == made, "training steps, with the cache and without, neither"
    model.eval()

    # The trial's graphs compute what graphs made at the first call compute: the same code, bit for bit.
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, out.logits, rtol=0, atol=0)


class CacheOff(TinyTransformer):
    """A model whose config turns a cache on that its forward cannot make: only calls with use_cache=False run."""

    def __init__(self):
        super().__init__(dim=32, num_layers=2, num_heads=4)
        self.config.use_cache = True

    def forward(self, ids, use_cache=None):
        if use_cache if use_cache is not None else self.config.use_cache:
            raise RuntimeError("no cache in this model")
        return super().forward(ids)


def test_a_default_call_that_fails_leaves_the_conversion_as_it_was_and_fails_as_written():
    """The default call's preparation is extra: where the model itself fails on that call, the conversion
    goes on, and the call raises the model's own error."""
    torch.manual_seed(0)
    model = CacheOff().eval()
    ids = example_ids(model.config)
    converted = attnres_fx.attnresify(model, (ids,))
    stats = conversion_of(converted).stats
    made = (stats.traces, stats.rewrites)
    assert made[0] == 2, "the capture's call in eval and train mode"
    with torch.no_grad():
        converted(ids, use_cache=False)
        with pytest.raises(RuntimeError, match="no cache in this model"):
            converted(ids)
    assert (stats.traces, stats.rewrites) == made
