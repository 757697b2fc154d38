"""What a user changes on a converted model after its first call is honoured at the next call, or refused
by name: a module replaced (a swapped ``final_res``, PEFT's ``modules_to_save``), a forward hook that
edits a block's output in place or returns a new one (activation steering), a block's constant (Granite's
``residual_multiplier``), a Python number that changes at every call (``start_pos``).

Numerical: the changed model's output equals that of a model converted with the change in place
(``fresh``): the same graphs on the same values, so equal up to the order of fp32 sums (1e-5 relative).
Each test fails where the routes kept what the first call saw.
"""

from __future__ import annotations

import copy

import pytest
import torch

import attnres_fx
from attnres_fx.checks import relative_error
from attnres_fx.conversion import conversion_of
from attnres_fx.testing import randomise_pseudo_queries
from hf_models import needs_hf

pytestmark = needs_hf

TOL = 1e-5
IDS = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(0))


def close(a, b, tol=TOL):
    assert a.shape == b.shape and relative_error(a, b) < tol, relative_error(a, b)


def llama(**config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100)
    return LlamaForCausalLM(LlamaConfig(**{**fields, **config})).eval()


def converted(model, **options):
    return randomise_pseudo_queries(attnres_fx.attnresify(model, block_size=2, **options))


def fresh(model, state, **options):
    """``model`` converted now, with ``state`` loaded: what the changed model must compute."""
    again = attnres_fx.attnresify(copy.deepcopy(model), block_size=2, **options)
    again.load_state_dict(state)
    return again


def replaced(model, name: str):
    """A copy of the AttnRes module at ``name`` with other pseudo-query weights, put in its place."""
    old = model.get_submodule(name)
    new = copy.deepcopy(old)
    with torch.no_grad():
        new.proj.weight.normal_(0, 2.0, generator=torch.Generator().manual_seed(1))
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent), attribute, new)
    return new


# -- modules replaced ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["model.final_res", "model.layers.1.attn_res"])
def test_an_attnres_module_replaced_after_the_first_call_is_the_one_called(name):
    model = converted(llama())
    with torch.no_grad():
        model(IDS)
        replaced(model, name)
        close(model(IDS).logits, fresh(llama(), model.state_dict())(IDS).logits)


def test_peft_modules_to_save_wrapped_after_a_warm_up_call_are_the_ones_trained():
    """PEFT's ``modules_to_save`` puts a wrapper in place of each named module that runs a trainable copy:
    the copy is what the converted model calls, its changes count."""
    peft = pytest.importorskip("peft")
    model = converted(llama())
    with torch.no_grad():
        model(IDS)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=True,
                                                         modules_to_save=["final_res", "mlp_res"]))
    copies = [m for name, m in wrapped.named_modules() if name.endswith("modules_to_save.default")]
    assert len(copies) == 5
    with torch.no_grad():
        for module in copies:
            module.proj.weight.add_(1.0)
        got = wrapped(IDS).logits
    # The base model's state with each copy's weights in the place of the module it wraps.
    state = {key.replace(".modules_to_save.default", "").replace(".base_layer", ""): value
             for key, value in wrapped.get_base_model().state_dict().items()
             if ".original_module." not in key and "lora_" not in key}
    with torch.no_grad():
        close(got, fresh(llama(), state)(IDS).logits)


@pytest.mark.slow
@pytest.mark.parametrize("route", ["model", "compiled"])
def test_an_attnres_module_replaced_after_the_first_call_is_the_one_called_on_dynamo_routes(route):
    """The routes that run TorchDynamo graphs: the model route (eager graphs calling the sites' modules) and
    attnres_fx.compile (Inductor graphs taking the sites' weights as inputs)."""
    options = {"route": "model"} if route == "model" else {}
    model = converted(llama(), **options)
    if route == "compiled":
        attnres_fx.compile(model)
    with torch.no_grad():
        model(IDS)
        replaced(model, "model.final_res")
        replaced(model, "model.layers.1.mlp_res")
        close(model(IDS).logits, fresh(llama(), model.state_dict(), **options)(IDS).logits)


# -- a block's output edited in place ---------------------------------------------------------------------

def _steered(model, v, how):
    """A hook adding ``v`` to layer 1's output: in place on the output or as a new output (the user's), or as a
    new MLP output (the reference: in AttnRes terms the same edit, v joins the stream's partial sum)."""
    if how == "in place":
        return model.model.layers[1].register_forward_hook(lambda module, args, out: out.add_(v))
    if how == "new output":
        return model.model.layers[1].register_forward_hook(lambda module, args, out: out + v)
    return model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out + v)


@pytest.mark.parametrize("mode", ["no_grad", "enable_grad", "inference_mode"])
def test_a_forward_hook_that_edits_a_block_output_reaches_the_next_block(mode):
    """Activation steering: ``out.add_(v)`` on a block's output, or ``out + v`` returned in its place, changes
    what every later block reads, gradients included."""
    model = converted(llama())
    context = getattr(torch, mode)
    results = {}
    for how in ("in place", "new output", "reference"):
        v = torch.randn(32, generator=torch.Generator().manual_seed(2)).requires_grad_(mode == "enable_grad")
        with context():
            model(IDS)                                   # a first call, before the hook
            handle = _steered(model, v, how)
            logits = model(IDS).logits
            handle.remove()
            if mode == "enable_grad":
                logits.square().sum().backward()
        results[how] = logits.detach(), v.grad
    with torch.no_grad():
        plain = model(IDS).logits
    assert relative_error(results["in place"][0], plain) > 0.01, "the edit has an effect"
    for how in ("in place", "new output"):
        close(results[how][0], results["reference"][0])
        if mode == "enable_grad":
            close(results[how][1], results["reference"][1])


def test_a_forward_hook_that_returns_a_new_block_output_acts_as_on_the_original():
    """Where the converted model computes the original function (``preserve_scale``, pseudo-queries at zero:
    every aggregate is the plain sum of its sources), a hook returning a new output, another function of it
    than a sum (``out * 0.5 + v``), changes the converted model's output as it changes the original's: the next
    block reads what the hook returned. fp32 sums in another order: 1e-5 relative."""
    v = torch.randn(32, generator=torch.Generator().manual_seed(2))
    original = llama()
    model = attnres_fx.attnresify(copy.deepcopy(original), block_size=2, preserve_scale=True)
    outputs = []
    for each in (original, model):
        with torch.no_grad():
            each(IDS)                                    # a first call, before the hook
            handle = each.model.layers[1].register_forward_hook(lambda module, args, out: out * 0.5 + v)
            outputs.append(each(IDS).logits)
            handle.remove()
            plain = each(IDS).logits
    assert relative_error(outputs[0], plain) > 0.01, "the hook has an effect"
    close(outputs[1], outputs[0])
    layer = model.model.layers[1]
    assert not layer._forward_hooks, "the user's hook removed, the routing's own goes at the next call"
    handle = layer.register_forward_hook(lambda module, args, out: out + v)
    with torch.no_grad():
        model(IDS)
    attnres_fx.remove(model)
    assert list(layer._forward_hooks) == [handle.id], "remove() takes the routing's hook off, the user's stays"



@pytest.mark.slow
def test_on_the_model_route_an_in_place_edit_of_a_block_output_is_refused_naming_the_layer_route():
    model = converted(llama(), route="model")
    with torch.no_grad():
        model(IDS)
    model.model.layers[1].register_forward_hook(lambda module, args, out: out.add_(1.0))
    with pytest.raises(attnres_fx.UnsupportedArchitectureError, match="(?s)model.layers.1.*route='layer'"):
        model(IDS)


# -- a block's constant changed ---------------------------------------------------------------------------

def granite(multiplier):
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    config = GraniteConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=100, residual_multiplier=multiplier)
    return GraniteForCausalLM(config).eval()


def test_a_block_constant_changed_after_the_first_call_is_read_at_the_next():
    """Granite scales each branch by its layers' ``residual_multiplier``, a plain float attribute the block's
    code reads: set on every layer after a call, the next call uses the new value."""
    model = converted(granite(0.5))
    with torch.no_grad():
        model(IDS)
        for layer in model.model.layers:
            layer.residual_multiplier = 0.9
        close(model(IDS).logits, fresh(granite(0.9), model.state_dict())(IDS).logits)
        traces = len(conversion_of(model).traces)
        model(IDS)
        assert len(conversion_of(model).traces) == traces, "the new value is traced once"


# -- Python numbers that change at every call ----------------------------------------------------------------

def handwritten(**overrides):
    from attnres_fx.testing.handwritten import HandwrittenConfig, Transformer

    torch.manual_seed(0)
    fields = dict(dim=32, layers=4, heads=4, vocab=100, max_batch=2, max_seq=64)
    return Transformer(HandwrittenConfig(**{**fields, **overrides})).eval()


def test_a_decoding_position_passed_as_a_python_int_reuses_one_graph():
    """Meta's reference Llama passes ``start_pos`` to every block as an int: a graph input, not a
    constant, so 40 decoding steps trace nothing new, and every step computes the original model's
    logits (converted with ``preserve_scale`` at zero init: the original function)."""
    original = handwritten()
    model = attnres_fx.attnresify(copy.deepcopy(original), (IDS,), preserve_scale=True)
    stats = conversion_of(model).stats
    length = IDS.shape[1]
    with torch.no_grad():
        close(model(IDS), original(IDS))
        close(model(IDS[:, :1], length), original(IDS[:, :1], length))
        before = (stats.traces, stats.rewrites, len(conversion_of(model).traces))
        for position in range(length + 1, length + 41):
            token = IDS[:, position % length:][:, :1]
            close(model(token, position), original(token, position))
        assert (stats.traces, stats.rewrites, len(conversion_of(model).traces)) == before


class NeedsItsStep(torch.nn.Module):
    """A block whose code needs the value of a Python number it is given (an ``if`` on it)."""

    def __init__(self, dim=32):
        super().__init__()
        self.norm, self.mlp = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, dim)

    def forward(self, x, step: int):
        scale = 1.0 if step % 2 == 0 else 0.5
        return x + scale * self.mlp(self.norm(x))


class Stepping(torch.nn.Module):
    def __init__(self, dim=32, layers=3):
        super().__init__()
        self.emb = torch.nn.Embedding(100, dim)
        self.layers = torch.nn.ModuleList(NeedsItsStep(dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, 100)

    def forward(self, ids, step: int = 0):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x, step)
        return self.head(x)


def test_a_python_number_whose_value_the_code_needs_gets_a_graph_per_value_within_the_cache_size():
    torch.manual_seed(0)
    original = Stepping().eval()
    model = attnres_fx.attnresify(copy.deepcopy(original), (IDS,), preserve_scale=True, trace_cache_size=4)
    conversion = conversion_of(model)
    with torch.no_grad():
        for step in [0, 1, 2, 3, 4, 5, 0, 1]:
            close(model(IDS, step), original(IDS, step))
    assert conversion.stats.evictions > 0 and len(conversion.traces) <= 4
    assert all(len(router._shapes) <= 4 for router in attnres_fx.routing.routers(model))
