"""Gradient deposits (Note [gradient deposits] in attnres_fx/op/kernels/cpu.cpp): in a training step's
backward, the nodes that read a block's view of a completed block sum (its sites, its bundle node) add
their gradients into the sum the block's unbundle node would make, instead of returning them for
autograd to sum in passes of its own.

Numerical: the gradients equal those of the Python stream edges, which make no deposits, bit for bit in
fp32 (the same terms summed in the same order: what came from the following blocks, then each site's
dL/dv as the backward reaches it). Structural: deposits are made, and sums written over in place, in a
training step; none in a backward that runs only some of the nodes. Failures: a backward that stops
half-way leaves nothing the next one picks up; two backwards of one graph at once each sum their own; a
gradient someone else holds is not written over.
"""

import copy
import threading

import pytest
import torch

import attnres_fx
from attnres_fx.models import TinyTransformer, example_ids
from attnres_fx.op.kernels import cpu
from attnres_fx.routing.state import StreamState, bundle, unbundle
from attnres_fx.testing import randomise_pseudo_queries
from attnres_fx.testing.handwritten import HandwrittenConfig, Transformer

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"the C++ kernel: {cpu.unavailable_reason()}")


def handwritten():
    torch.manual_seed(0)
    model = Transformer(HandwrittenConfig(dim=64, layers=4, heads=2, vocab=128, max_batch=2, max_seq=16)).eval()
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    return randomise_pseudo_queries(attnres_fx.attnresify(model, (ids,))).train(), ids


def tiny():
    torch.manual_seed(0)
    model = TinyTransformer(dim=32, num_layers=4, num_heads=4).eval()
    return randomise_pseudo_queries(attnres_fx.attnresify(model, block_size=2)).train(), example_ids(model.config)


def loss_of(model, ids):
    return model(ids).float().square().mean()


def grads(model, ids, monkeypatch=None):
    """The parameters' gradients of one backward; with ``monkeypatch``, through the Python stream edges."""
    if monkeypatch is not None:
        monkeypatch.setattr(cpu.Entries, "bundle", None)
        monkeypatch.setattr(cpu.Entries, "unbundle", None)
    try:
        model.zero_grad(set_to_none=True)
        loss_of(model, ids).backward()
    finally:
        if monkeypatch is not None:
            monkeypatch.undo()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def deposits():
    return cpu.Entries.deposit_counts()


@pytest.mark.parametrize("make", [handwritten, tiny])
def test_deposited_gradients_are_the_sums_autograd_makes_bit_for_bit(make, monkeypatch):
    model, ids = make()
    before = deposits()
    deposited = grads(model, ids)
    made, written_over = (a - b for a, b in zip(deposits(), before))
    assert made > 0 and written_over > 0
    middle = deposits()
    summed = grads(model, ids, monkeypatch)
    assert deposits() == middle
    for name, grad in summed.items():
        assert torch.equal(deposited[name], grad), name


def test_a_backward_that_runs_only_some_nodes_deposits_nothing():
    """torch.autograd.grad runs the nodes on its inputs' paths only: a site's backward may run where the
    unbundle node that would take its deposit does not, so no node deposits (and the gradients are
    autograd's, equal to a full backward's)."""
    model, ids = handwritten()
    full = grads(model, ids)
    names, params = zip(*model.named_parameters())
    before = deposits()
    got = torch.autograd.grad(loss_of(model, ids), params)
    assert deposits() == before
    for name, grad in zip(names, got):
        assert torch.equal(grad, full[name]), name


def test_a_partial_backward_of_a_kept_graph_leaves_nothing_for_the_full_one():
    model, ids = handwritten()
    full = grads(model, ids)
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, ids)
    torch.autograd.grad(loss, [model.layers[2].attn_res.proj.weight], retain_graph=True)
    loss.backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, full[name]), name


def test_a_backward_stopped_half_way_leaves_no_deposit_for_the_next():
    """An exception in the middle of a block's backward (here a hook on its attention's weight, after the
    block's bundle node and its MLP's site deposited, before its unbundle node took the deposits in): the
    next backward of the same graph does not read them (the holder keeps deposits per graph task) and
    gets what a backward that never failed gets."""
    model, ids = handwritten()
    full = grads(model, ids)
    failed = []

    def fail_once(grad):
        if not failed:
            failed.append(True)
            raise RuntimeError("stop")
        return grad

    handle = model.layers[2].attention.wq.weight.register_hook(fail_once)
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, ids)
    before = deposits()
    with pytest.raises(RuntimeError, match="stop"):
        loss.backward(retain_graph=True)
    assert deposits()[0] > before[0]
    model.zero_grad(set_to_none=True)
    loss.backward()
    handle.remove()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, full[name]), name


def test_two_backwards_of_one_graph_on_two_threads_each_take_in_their_own_deposits():
    """Two threads run the backward of one kept graph at the same time: every gradient reaches the
    parameters once per backward (twice a full backward's, to fp32 round-off of the two sums' order)."""
    model, ids = handwritten()
    full = grads(model, ids)
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, ids)
    barrier = threading.Barrier(2)
    errors = []

    def backward():
        try:
            barrier.wait()
            loss.backward(retain_graph=True)
        except Exception as err:      # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=backward) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * full[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_deposited_gradient_someone_else_holds_is_not_written_over():
    """The following block's gradient for a state tensor, deposited by the bundle node, is added to by the
    site's kernel into a new tensor where another reference to it exists (here the test's own): only a
    sum nothing else sees is written over."""
    torch.manual_seed(0)
    block, carrier = torch.randn(2, 8, 16, requires_grad=True), torch.randn(2, 8, 16, requires_grad=True)
    proj, norm = torch.randn(1, 16, requires_grad=True), torch.rand(16) + 0.5
    state = StreamState(owner=None, stream=0, position=1, blocks=(block,))
    read, (view,) = unbundle(state, carrier)
    out = torch.ops.attnres_cpu.aggregate([view, read], proj, norm, 1e-6, False)
    following = StreamState(owner=None, stream=0, position=2, blocks=(view,))
    returned = bundle(out, (view,), following)
    assert "BundleFunction" in returned.grad_fn.name()
    later = torch.randn(2, 8, 16)
    kept = later.clone()
    cpu.Entries.add_grads(following.holder, [later])
    before = deposits()
    returned.sum().backward()
    made, written_over = (a - b for a, b in zip(deposits(), before))
    assert (made, written_over) == (2, 0)
    assert torch.equal(later, kept)
    site = torch.autograd.grad(torch.ops.attnres_cpu.aggregate([block, carrier], proj, norm, 1e-6, False).sum(),
                               block)[0]
    got, = cpu.Entries.take_grads(state.holder, 1)          # what the block that made `state` would take
    assert torch.equal(got, kept + site)


def test_bf16_deposits_round_once_where_autograd_rounds_each_term(monkeypatch):
    """In bf16 a deposit adds each site's dL/dv to the sum in fp32 and rounds the sum once, where autograd
    rounds the term, then the sum: the two agree to bf16's rounding of the largest terms."""
    model, ids = tiny()
    model = copy.deepcopy(model).to(torch.bfloat16)
    deposited = grads(model, ids)
    summed = grads(model, ids, monkeypatch)
    for name, grad in summed.items():
        torch.testing.assert_close(deposited[name].float(), grad.float(), rtol=2 ** -6, atol=1e-3, msg=name)
