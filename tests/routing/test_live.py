"""Live conversion: a converted model is the same model with AttnRes inside.

Same object and structure, any call signature, train/eval and the semantics of its forward (dropout,
``no_grad`` and autocast regions, activation checkpointing), dtype moves, the lifecycle (buffers and RNG
untouched by conversion, remove, copies, pickles, checkpoints), training eager and compiled, and a
user's own ``torch.compile``.
"""

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import attnres_fx
from attnres_fx.testing import randomise_pseudo_queries
from toy_models import NanoGPT, make_inputs
from conftest import cold_compile

EXACT = 1e-5        # preserve_scale=True: the original function up to fp32 reassociation of the sums


def nano(**options):
    torch.manual_seed(0)
    return NanoGPT(**options).eval()


def convert(model, *inputs, **options):
    return attnres_fx.attnresify(copy.deepcopy(model), inputs or (make_inputs(),), preserve_scale=True, **options)


# The main tests run on the default route (the layer route for these models); the ones marked with
# ``both_routes`` run on the model route as well.
both_routes = pytest.mark.parametrize("route", ["layer", "model"])


def relative(a, b):
    return float((a - b).abs().max() / b.abs().max())


# -- 2. the same object ------------------------------------------------------------------------------------

def test_same_object_class_submodules_methods_and_attributes():
    model = nano()
    before = repr(model)
    converted = attnres_fx.attnresify(model, (make_inputs(),))
    assert converted is model and type(model) is NanoGPT
    assert isinstance(model.h[0], nn.Module) and len(model.h) == 2 and model.h[1].attn.qkv.in_features == 32
    assert model.note == "a plain attribute" and model.num_params() == sum(p.numel() for p in model.parameters())
    assert model.h[0].attn_res.site.name == "h.0.attn_res"
    # repr: the original's lines, plus the AttnRes modules.
    added = [line.strip() for line in repr(model).splitlines() if line not in before.splitlines()]
    heads = [line for line in added if "BlockAttnRes(" in line]
    # (repr folds identical layers: "(0-1): 2 x NanoBlock(")
    assert {line.split(":")[0] for line in heads} == {f"({site.name.rsplit('.', 1)[-1]})"
                                                      for site in attnres_fx.sites(model)}
    assert all(line in heads or line == ")" or line.startswith(("(proj): PseudoQuery(", "(norm): RMSNorm(", "dim="))
               for line in added), added
    assert set(before.splitlines()) <= set(repr(model).splitlines())


@both_routes
def test_forward_hooks_on_a_layer_fire_with_the_real_input_even_when_added_later(route):
    model = convert(nano(), route=route)
    x = make_inputs()
    model(x)                                           # captured once without the hook
    seen = []
    handle = model.h[1].register_forward_hook(lambda module, args, output: seen.append((args[0], output)))
    logits, _ = model(x)
    assert len(seen) == 1, "a hook registered after the first call fires (Dynamo guards on it)"
    layer_input, layer_output = seen[0]
    assert isinstance(layer_input, torch.Tensor) and layer_input.shape == (2, 8, 32)
    # The layer's input at zero init with preserve_scale is the original stream there.
    original = nano()
    reference = []
    original.h[1].register_forward_hook(lambda module, args, output: reference.append(args[0]))
    original(x)
    torch.testing.assert_close(layer_input, reference[0], rtol=EXACT, atol=EXACT)
    handle.remove()
    model(x)
    assert len(seen) == 1, "a removed hook no longer fires"


@both_routes
def test_forward_hooks_added_later_fire_after_torch_compiler_reset(route):
    """A reset (as test suites and notebooks do between models) drops Dynamo's caches and the settings
    it had compiled with: a routed call's next compile still guards the layers' hook dicts."""
    convert(nano(), route=route)(make_inputs())
    torch.compiler.reset()
    model = convert(nano(), route=route)
    x = make_inputs()
    model(x)
    seen = []
    model.h[1].register_forward_hook(lambda module, args, output: seen.append(output))
    model(x)
    assert len(seen) == 1


# -- 3. call signatures ------------------------------------------------------------------------------------

@both_routes
def test_positional_keyword_and_optional_arguments(route):
    model = nano()
    converted = convert(model, route=route)
    x, y = make_inputs(), make_inputs(seed=1)
    calls = [((x,), {}), ((), {"idx": x}), ((x, y), {}), ((x,), {"targets": y}), ((), {"idx": x, "targets": y})]
    for args, kwargs in calls:
        got, want = converted(*args, **kwargs), model(*args, **kwargs)
        assert relative(got[0], want[0]) < EXACT
        assert (got[1] is None) == (want[1] is None) == ("targets" not in kwargs and len(args) < 2)
        if want[1] is not None:
            assert relative(got[1], want[1]) < EXACT


# -- 4. modes and semantics --------------------------------------------------------------------------------

@both_routes
def test_train_and_eval_switch_dropout_after_conversion(route):
    model = convert(nano(dropout=0.5), route=route)
    x = make_inputs()
    with torch.no_grad():
        assert torch.equal(model(x)[0], model(x)[0]), "eval: dropout off, deterministic"
        model.train()
        assert not torch.equal(model(x)[0], model(x)[0]), "train: dropout on"
        model.eval()
        assert torch.equal(model(x)[0], model(x)[0])
    assert not model.h[0].attn_res.training


@both_routes
def test_a_no_grad_region_inside_forward_still_blocks_gradients(route):
    model = convert(nano(), route=route)
    logits, loss = model(make_inputs(), make_inputs(seed=1))
    loss.backward()
    assert model.wpe.weight.grad is None, "positions were computed under no_grad"
    assert model.wte.weight.grad is not None and model.h[1].mlp_res.proj.weight.grad is not None


@both_routes
def test_an_autocast_region_inside_forward_still_runs_in_low_precision(route):
    model = nano(autocast_head=True)
    converted = convert(model, route=route)
    logits, _ = converted(make_inputs())
    assert logits.dtype == torch.bfloat16
    # bf16 rounding of the head's inputs and weights (8 significant bits): a few parts in a thousand.
    assert relative(logits.float(), model(make_inputs())[0].float()) < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@both_routes
def test_dtype_moves_after_conversion(dtype, route):
    model = convert(nano(), route=route)
    x = make_inputs()
    reference = model(x)[0]
    model.to(dtype)
    assert model.h[0].attn_res.proj.weight.dtype == dtype
    logits = model(x)[0]
    assert logits.dtype == dtype
    tolerance = 2e-2 if dtype == torch.bfloat16 else EXACT
    assert relative(logits.float(), reference) < tolerance


# -- 5. lifecycle ------------------------------------------------------------------------------------------

def test_conversion_changes_no_buffer_and_no_rng_state():
    class WithBatchNorm(NanoGPT):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(32)

        def forward(self, idx, targets=None):
            logits, loss = super().forward(idx, targets)
            return logits + self.bn(self.wte(idx).transpose(1, 2)).transpose(1, 2).sum(-1, keepdim=True), loss

    torch.manual_seed(0)
    model = WithBatchNorm().train()
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    rng = torch.get_rng_state()
    attnres_fx.attnresify(model, (make_inputs(),))
    assert torch.equal(torch.get_rng_state(), rng), "nothing random ran"
    for key, value in model.named_buffers():
        assert torch.equal(value, buffers[key]), f"{key} changed"
    model(make_inputs())
    assert not torch.equal(model.bn.running_mean, buffers["bn.running_mean"]), "a real call updates them"


def test_remove_restores_the_original_exactly():
    model = nano()
    x = make_inputs()
    reference_state = {k: v.clone() for k, v in model.state_dict().items()}
    expected = model(x)[0]
    converted = randomise_pseudo_queries(attnres_fx.attnresify(model, (x,)))
    assert relative(converted(x)[0], expected) > 1e-3
    assert attnres_fx.remove(model) is model
    assert not attnres_fx.is_converted(model) and "forward" not in model.__dict__
    assert list(model.state_dict()) == list(reference_state)
    assert torch.equal(model(x)[0], expected)
    attnres_fx.attnresify(model, (x,))                 # and it converts again
    assert attnres_fx.is_converted(model)


def test_failing_conversions_leave_the_model_bit_identical(untouched):
    model = nano()
    check = untouched(model, make_inputs())
    with pytest.raises(ValueError):
        attnres_fx.attnresify(model, (make_inputs(),), block_size=1, num_blocks=1)
    with pytest.raises(attnres_fx.TraceError):
        attnres_fx.attnresify(model, (make_inputs(), make_inputs(), make_inputs()))      # wrong call
    block = model.h[1]
    block.forward = lambda x: type(block).forward(block, x)        # someone else's wrapper is on a block
    with pytest.raises(attnres_fx.AttnResError, match="instance attribute 'forward'"):
        attnres_fx.attnresify(model, (make_inputs(),))
    del model.h[1].forward
    model.forward = lambda *args: None                  # on the root it only matters to the model route
    with pytest.raises(attnres_fx.AttnResError, match="instance attribute 'forward'"):
        attnres_fx.attnresify(model, (make_inputs(),), route="model")
    del model.forward
    check()
    assert "forward" not in model.__dict__ and not attnres_fx.sites(model)


def _pickled(model):
    return pickle.loads(pickle.dumps(model))


def _torch_saved(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("copier", [copy.deepcopy, _pickled, _torch_saved], ids=["deepcopy", "pickle", "torch.save"])
@both_routes
def test_copies_and_pickles_stay_converted(copier, route):
    model = randomise_pseudo_queries(convert(nano(), route=route))
    x = make_inputs()
    expected = model(x)[0]
    clone = copier(model)
    routers = attnres_fx.routing.routers(clone)
    assert attnres_fx.is_converted(clone) and routers and all(router.root is clone for router in routers)
    assert [s.name for s in attnres_fx.sites(clone)] == [s.name for s in attnres_fx.sites(model)]
    torch.testing.assert_close(clone(x)[0], expected)
    with torch.no_grad():
        clone.h[0].mlp_res.proj.weight.add_(1.0)
    assert relative(clone(x)[0], expected) > 1e-4, "the copy computes with its own weights"
    torch.testing.assert_close(model(x)[0], expected)


def test_checkpoints_round_trip_and_an_original_checkpoint_misses_only_attnres_keys():
    model = randomise_pseudo_queries(convert(nano()))
    x = make_inputs()
    fresh = convert(nano())
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(fresh(x)[0], model(x)[0])
    original_state = nano().state_dict()
    result = fresh.load_state_dict(original_state, strict=False)
    assert not result.unexpected_keys
    assert sorted(result.missing_keys) == sorted(k for k in fresh.state_dict() if "_res." in k)


# -- 6. training ---------------------------------------------------------------------------------------

def _train(model, steps=4):
    x, y = make_inputs(batch=4, seq=16, seed=3), make_inputs(batch=4, seq=16, seed=4)
    before = {s.name: model.get_submodule(s.name).proj.weight.detach().clone() for s in attnres_fx.sites(model)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    moved = {s.name: not torch.equal(model.get_submodule(s.name).proj.weight, before[s.name])
             for s in attnres_fx.sites(model)}
    return losses, moved


# Under Inductor: tests/integrations/test_training.py's unfreeze test (one training compile for the suite).
def test_an_optimizer_built_after_conversion_trains_every_multi_source_query():
    model = convert(nano(dropout=0.0)).train()
    losses, moved = _train(model)
    assert losses[-1] < losses[0]
    for site in attnres_fx.sites(model):
        assert moved[site.name] == (site.num_sources > 1), site.name


@cold_compile
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "inductor"])
def test_a_new_sequence_length_recompiles_at_most_once_more(compiled):
    from torch._dynamo.utils import counters

    model = convert(nano())
    if compiled:
        attnres_fx.compile(model)
    counters.clear()
    for seq in (8, 12, 16, 20, 9):
        model(make_inputs(seq=seq))
    # Eager: the blocks' graphs do not depend on shapes (one trace for the kind of block, one rewritten
    # graph per block), and nothing runs on Dynamo. Inductor compiles the whole call: the first call for
    # its shapes; the second length makes Dynamo mark the dimension dynamic and compile once more (unless
    # Dynamo remembers from an earlier compilation in the process that it varies); later lengths reuse
    # that graph.
    routers = attnres_fx.routing.routers(model)
    graphs = counters["stats"]["unique_graphs"]
    if compiled:
        root = model.__dict__["forward"]
        assert isinstance(root, attnres_fx.routing.WholeCallRouter) and root.whole
        assert 1 <= graphs <= 2, dict(counters["stats"])
    else:
        assert len(routers) == len(model.h)
        # One trace for the kind of block in each mode, train and eval (both made by the conversion's trial).
        assert graphs == 0 and len(attnres_fx.conversion.conversion_of(model).traces) == 2
        assert [len(router.rewritten) for router in routers] == [1] * len(model.h)


@cold_compile
@pytest.mark.slow
@both_routes
def test_eager_and_inductor_routes_agree(route):
    model = randomise_pseudo_queries(convert(nano(), route=route))
    x = make_inputs()
    eager = model(x)[0]
    attnres_fx.compile(model)
    torch.testing.assert_close(model(x)[0], eager, rtol=1e-5, atol=1e-5)
    # Without gradients (inference) the compiled graphs take the two-phase schedule: exact, to fp32
    # reassociation.
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], eager, rtol=1e-5, atol=1e-5)
    inference = [graph for router in attnres_fx.routing.routers(model) for graph in router.rewritten
                 if any(n.meta.get("attnres", {}).get("role") == "phase1" for n in graph.graph.nodes)]
    assert inference, "a no-grad call compiles the two-phase schedule"
    attnres_fx.compile(model, backend="eager")
    torch.testing.assert_close(model(x)[0], eager)


# -- 7. a user's own torch.compile -----------------------------------------------------------------------

@both_routes
def test_torch_compile_by_the_user_runs_attnres_or_says_what_to_use(route):
    model = randomise_pseudo_queries(convert(nano(), route=route))
    x = make_inputs()
    expected = model(x)[0]
    torch._dynamo.reset()
    compiled = torch.compile(model)
    torch.testing.assert_close(compiled(x)[0], expected, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    with pytest.raises(attnres_fx.ForeignCompileError, match="attnres_fx.compile"):
        torch.compile(model, fullgraph=True)(x)


@both_routes
def test_torch_export_by_the_user_says_what_to_use(route):
    model = convert(nano(), route=route)
    with pytest.raises(Exception, match="attnres_fx.rewrite"):
        torch.export.export(model, (make_inputs(),), strict=False)


def _saved_activations(model, x, y):
    """How many tensors autograd saves for the backward pass of one training step."""
    count = [0]

    def pack(tensor):
        count[0] += 1
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _, loss = model(x, y)
    loss.backward()
    return count[0]


@both_routes
def test_activation_checkpointing_inside_blocks_still_recomputes(route):
    plain, checkpointed = nano(dropout=0.0), nano(dropout=0.0, checkpoint=True)
    x, y = make_inputs(), make_inputs(seed=1)
    converted = {name: randomise_pseudo_queries(convert(m, route=route)).train() for name, m in
                 (("plain", plain), ("checkpointed", checkpointed))}
    runs = {name: [] for name in converted}
    for name, model in converted.items():
        model.h[1].mlp_res.register_forward_hook(lambda *args, name=name: runs[name].append(1))
        model.zero_grad()
        runs[name].clear()
        saved = _saved_activations(model, x, y)
        runs[name + "_saved"] = saved
    # Same function, same gradients.
    for (name, p), (_, q) in zip(converted["plain"].named_parameters(), converted["checkpointed"].named_parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    # Recomputation: the checkpointed model runs its layers' AttnRes again in the backward pass, and
    # keeps fewer activations.
    assert len(runs["plain"]) == 1 and len(runs["checkpointed"]) == 2
    assert runs["checkpointed_saved"] < runs["plain_saved"]


@pytest.mark.parametrize("route, message", [
    ("layer", r"ran the first modules of residual stream 0 but not its last one \(h\.2\)"),
    ("model", r"planned but not found now: h\.2 \(attn\), h\.2 \(mlp\)")])
def test_a_call_ending_the_stream_early_raises_naming_the_sites(route, message):
    class Skipping(NanoGPT):
        def forward(self, idx, targets=None, depth=None):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.h[:depth]:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    torch.manual_seed(0)
    model = attnres_fx.attnresify(Skipping(dropout=0.0, layers=3).eval(), (make_inputs(),), route=route)
    model(make_inputs())
    with pytest.raises(attnres_fx.StreamMismatchError, match=message):
        model(make_inputs(), depth=2)
