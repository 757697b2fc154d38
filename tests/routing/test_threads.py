"""Converted models called from several threads at once, as servers and data loaders call them.

Numerical: every output (and every gradient) of a concurrent call equals that of the same call made
serially, exactly (the same ops on the same inputs: torch.equal), on both routes; the first calls may
race (graphs are traced while other threads run). Failure: nothing raised in any thread; an output
equal to the *original* model's instead (AttnRes silently skipped) is the failure this guards against,
and is reported as such.
"""

import copy
import threading

import pytest
import torch

import attnres_fx
from attnres_fx.testing import randomise_pseudo_queries

pytest.importorskip("transformers")

THREADS = 4
CALLS = 12


def llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)
    return LlamaForCausalLM(config).eval()


def inputs(count=CALLS):
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(1, 100, (2, 4 + k % 5), generator=generator) for k in range(count)]


def run_threads(work, count=THREADS):
    errors = []

    def guarded(index):
        try:
            work(index)
        except Exception as err:  # noqa: BLE001 - collected and reported by the test
            errors.append(f"thread {index}: {type(err).__name__}: {err}")
    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, "\n".join(errors)


def differing(got, want, original):
    """Indices whose output differs from the serial one, each marked if it is the original model's."""
    return [(k, torch.allclose(g, o, atol=1e-6)) for k, (g, w, o) in enumerate(zip(got, want, original))
            if not torch.equal(g, w)]


# The model route's TorchDynamo captures from four threads take tens of seconds: make test's, not the edit loop's.
@pytest.mark.parametrize("route", ["layer", pytest.param("model", marks=pytest.mark.slow)])
def test_one_model_called_from_several_threads_gives_the_serial_outputs(route):
    base = llama()
    model = randomise_pseudo_queries(attnres_fx.attnresify(copy.deepcopy(base), route=route))
    calls = inputs()
    with torch.inference_mode():
        original = [base(x).logits for x in calls]
    reference = randomise_pseudo_queries(attnres_fx.attnresify(copy.deepcopy(base), route=route))
    reference.load_state_dict(model.state_dict())
    with torch.inference_mode():
        want = [reference(x).logits for x in calls]
    got = [[None] * len(calls) for _ in range(THREADS)]

    def work(thread):
        with torch.inference_mode():
            for k in range(len(calls)):
                index = (k + 3 * thread) % len(calls)       # threads meet the same shapes at different times
                got[thread][index] = model(calls[index]).logits
    run_threads(work)       # cold: the first calls of every shape race
    for thread in range(THREADS):
        assert not differing(got[thread], want, original), f"thread {thread}: (index, is the original's)"


def test_two_models_in_two_threads_give_their_serial_outputs():
    models = [randomise_pseudo_queries(attnres_fx.attnresify(llama(seed))) for seed in (0, 1)]
    calls = inputs()
    with torch.inference_mode():
        want = [[model(x).logits for x in calls] for model in models]
    got = [[None] * len(calls), [None] * len(calls)]

    def work(index):
        with torch.inference_mode():
            for k, x in enumerate(calls):
                got[index][k] = models[index](x).logits
    run_threads(work, count=2)
    for index in range(2):
        assert all(torch.equal(g, w) for g, w in zip(got[index], want[index])), f"model {index}"


def test_training_in_two_threads_gives_the_serial_gradients():
    """Two converted models trained in two threads (each its own backward): every step's loss and the
    final parameters equal a serial run's."""
    def train(model, calls):
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for x in calls:
            optimizer.zero_grad()
            loss = model(x, labels=x).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        return losses

    calls = inputs(6)
    serial = [randomise_pseudo_queries(attnres_fx.attnresify(llama(seed))) for seed in (0, 1)]
    concurrent = [copy.deepcopy(model) for model in serial]
    want = [train(model, calls) for model in serial]
    got = [None, None]
    run_threads(lambda index: got.__setitem__(index, train(concurrent[index], calls)), count=2)
    for index in range(2):
        assert all(torch.equal(g, w) for g, w in zip(got[index], want[index])), f"losses of model {index}"
        for (name, p), q in zip(concurrent[index].named_parameters(), serial[index].parameters()):
            assert torch.equal(p, q), f"model {index}: {name}"


@pytest.mark.slow
def test_a_model_route_call_leaves_other_threads_output_recorders_alone():
    """transformers records ``output_hidden_states`` through a per-call collector; a converted model's
    TorchDynamo call makes it traceable for its own thread only: another thread's model (unconverted,
    or converted on the layer route) collects every hidden state while it runs."""
    compiled = attnres_fx.attnresify(llama(), route="model")
    victims = {"unconverted": llama(1), "layer route": attnres_fx.attnresify(llama(2))}
    x = inputs(1)[0]
    with torch.no_grad():
        compiled(x)
        want = {name: len(model(x, output_hidden_states=True).hidden_states) for name, model in victims.items()}
    stop = threading.Event()

    def busy(_):
        with torch.no_grad():
            while not stop.is_set():
                compiled(x)
    runner = threading.Thread(target=busy, args=(0,))
    runner.start()
    short = []
    try:
        with torch.no_grad():
            for _ in range(60):
                for name, model in victims.items():
                    got = model(x, output_hidden_states=True).hidden_states
                    if got is None or len(got) != want[name]:
                        short.append((name, None if got is None else len(got)))
    finally:
        stop.set()
        runner.join()
    assert not short, f"{len(short)} of 120 calls lost hidden states: {short[:4]}"


def test_the_routing_keeps_what_calls_share_in_one_call_context_per_thread():
    """Structural: no module of the routing or the capture holds a thread-local; the one call context
    (attnres_fx's own calls in progress, interceptors, stream watches, compilation settings, hooked results)
    is another object in each thread. The one thread-local left is transformers' collector held for
    attnres_fx's Dynamo calls (compat): Dynamo reads it inside its graph and cannot trace a ContextVar."""
    import importlib
    import pkgutil

    from attnres_fx import capture, compat, routing
    from attnres_fx.capture.tracers import in_own_call, own_call
    from attnres_fx.context import call_context

    packages = [routing, capture, compat]
    modules = [importlib.import_module(f"{package.__name__}.{info.name}") for package in packages
               for info in pkgutil.iter_modules(package.__path__)]
    held = [f"{module.__name__}.{name}" for module in [*packages, *modules] for name, value in vars(module).items()
            if isinstance(value, threading.local)]
    assert held == ["attnres_fx.compat.transformers._HELD_COLLECTOR"]
    contexts = []
    run_threads(lambda index: contexts.append(call_context()), count=2)
    assert len({id(context) for context in [call_context(), *contexts]}) == 3
    with own_call():
        assert in_own_call() and call_context().own == 1
        elsewhere = []
        run_threads(lambda index: elsewhere.append(in_own_call()), count=2)
        assert elsewhere == [False, False], "attnres_fx's own call in this thread is not another thread's"
    assert not in_own_call()
