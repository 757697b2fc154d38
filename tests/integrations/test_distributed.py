"""Converted models trained the way large models are: two CPU processes over gloo, each way of
distributing checked against a single-process run of the same converted model (random pseudo-queries,
boundaries inside layers) on the same global batches.

One spawn for the whole file: every check runs in it, in turn, and the tests read what each rank found.
Tolerances: fp32 runs agree to 1e-6 relative (summation order of the reductions); bf16 compute
(FSDP2 ``MixedPrecisionPolicy``) to 2e-2 of the parameter change; Inductor to 1e-5.
"""

import os
import sys
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import attnres_fx
from attnres_fx.models import TinyConfig, TinyTransformer
from attnres_fx.testing import randomise_pseudo_queries

sys.path.insert(0, os.path.dirname(__file__))

# The first test waits for the one spawn that runs every scenario of this file (about a minute on two quiet
# cores): more than the 120 s default on a busy machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]

STEPS = 3
LR = 0.1
BATCH, SEQ, VOCAB = 4, 12, 64          # the global batch; each rank trains on half of it


def model(layers=4, block_size=3, route="auto"):
    torch.manual_seed(0)
    net = TinyTransformer(TinyConfig(vocab_size=VOCAB, dim=32, num_layers=layers, num_heads=4, max_seq_len=SEQ))
    ids = batch(0)[0]
    attnres_fx.attnresify(net, (ids,), block_size=block_size, route=route)
    return randomise_pseudo_queries(net).train()


def batch(step):
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def loss_of(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def reference(layers=4, steps=STEPS):
    """Single process, the whole global batch, plain SGD: the parameters after ``steps`` steps."""
    net = model(layers)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(steps):
        ids, targets = batch(step)
        optimizer.zero_grad()
        loss_of(net(ids), targets).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in net.named_parameters()}


def reference_bf16(layers=4, steps=STEPS):
    """As :func:`reference`, with FSDP2's mixed precision as two ranks run it: bf16 parameters and
    compute on each half of the batch, the halves' gradients averaged in fp32 into fp32 parameters."""
    master = model(layers)
    compute = model(layers).to(torch.bfloat16)
    optimizer = torch.optim.SGD(master.parameters(), lr=LR)
    for step in range(steps):
        with torch.no_grad():
            for low, high in zip(compute.parameters(), master.parameters()):
                low.copy_(high)
        ids, targets = batch(step)
        grads = [torch.zeros_like(p) for p in master.parameters()]
        for half in (slice(0, BATCH // 2), slice(BATCH // 2, BATCH)):
            compute.zero_grad()
            loss_of(compute(ids[half]), targets[half]).backward()
            for total, low in zip(grads, compute.parameters()):
                total += low.grad.float() / 2
        for high, grad in zip(master.parameters(), grads):
            high.grad = grad
        optimizer.step()
    return {name: p.detach().clone() for name, p in master.named_parameters()}


def train_data_parallel(net, rank, steps=STEPS):
    """Each rank its half of every global batch; gradient averaging makes it the global batch's step."""
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(steps):
        ids, targets = batch(step)
        half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
        optimizer.zero_grad()
        loss_of(net(ids[half]), targets[half]).backward()
        optimizer.step()


def full_parameters(net):
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in net.named_parameters()}


def relative_gap(got, want, initial=None):
    """The largest difference over all parameters relative to the largest parameter (with ``initial``: of
    the parameter changes, relative to the largest change), and the tensor where it is: a scale that a
    near-zero bias cannot inflate into fp32 round-off of its own size."""
    base = {name: value if initial is None else value - initial[name] for name, value in want.items()}
    other = {name: got[name] if initial is None else got[name] - initial[name] for name in want}
    scale = max(float(value.abs().max()) for value in base.values())
    gaps = {name: float((other[name] - base[name]).abs().max()) / scale for name in want}
    worst = max(gaps, key=gaps.get)
    return gaps[worst], worst


# -- the checks, each run on both ranks --------------------------------------------------------------------

def check_ddp(rank, want):
    net = model()
    train_data_parallel(torch.nn.parallel.DistributedDataParallel(net), rank)
    return relative_gap(full_parameters(net), want)


def check_fsdp_per_block(rank, want, reshard_after_forward=True, mp_policy=None, checkpoint=False,
                         compile_blocks=False, layers=4):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    net = model(layers)
    initial = full_parameters(net)
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for index, block in enumerate(net.blocks):
            net.blocks[index] = checkpoint_wrapper(block)
    if compile_blocks:
        attnres_fx.compile(net)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp_policy else \
        MixedPrecisionPolicy()
    for block in net.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(net, mp_policy=policy)
    train_data_parallel(net, rank)
    got = {name.replace("._checkpoint_wrapped_module", ""): p for name, p in full_parameters(net).items()}
    return relative_gap(got, want, initial if mp_policy else None)


def check_fsdp_reentrant_wrapper(rank, want):
    """``checkpoint_wrapper`` in its reentrant form, then ``fully_shard`` per block and root."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    net = model()
    for index, block in enumerate(net.blocks):
        net.blocks[index] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.REENTRANT)
        fully_shard(net.blocks[index])
    fully_shard(net)
    train_data_parallel(net, rank)
    got = {name.replace("._checkpoint_wrapped_module", ""): p for name, p in full_parameters(net).items()}
    return relative_gap(got, want)


def check_hf_gradient_checkpointing(rank):
    """A Llama's own ``gradient_checkpointing_enable()`` (reentrant, as transformers defaults to), then
    ``fully_shard`` per decoder layer and root, against one process without checkpointing."""
    from torch.distributed.fsdp import fully_shard

    from attnres_fx.models import build_hf

    ids = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))

    def llama():
        torch.manual_seed(0)
        net = build_hf("llama")
        attnres_fx.attnresify(net, (ids,), block_size=1)
        return randomise_pseudo_queries(net).train()

    # The reference runs each rank's half on its own too: a Llama converted with random pseudo-queries
    # magnifies the round-off of fp32 reductions over a batch of another size (5e-6 after 3 steps).
    single = llama()
    optimizer = torch.optim.SGD(single.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        for half in (slice(0, BATCH // 2), slice(BATCH // 2, BATCH)):
            (single(ids[half], labels=ids[half]).loss / 2).backward()
        optimizer.step()
    want = full_parameters(single)
    net = llama()
    net.gradient_checkpointing_enable()
    for layer in net.model.layers:
        fully_shard(layer)
    fully_shard(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    for _ in range(STEPS):
        optimizer.zero_grad()
        net(ids[half], labels=ids[half]).loss.backward()
        optimizer.step()
    return relative_gap(full_parameters(net), want)


def check_user_block_compile(rank, want):
    net = model(2)
    net.blocks[0].compile(fullgraph=True)
    try:
        net(batch(0)[0])
    except attnres_fx.AttnResError as err:
        return "typed", str(err)
    except Exception as err:  # noqa: BLE001 - the test reports what happened
        return "untyped", f"{type(err).__name__}: {err}"
    return "ran", ""


def check_pipeline(rank, want, schedule, stages_per_rank=1, cached=False, microbatches=2):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules

    world = dist.get_world_size()
    net = model()
    num_stages = world * stages_per_rank
    splits = [f"blocks.{k}" for k in range(1, num_stages)] if num_stages > 2 else ["blocks.2"]
    stages = attnres_fx.pipeline_stages(net, splits, example_inputs=(batch(0)[0][:BATCH // microbatches],),
                                        ranks=world if cached else None)
    mine = [k for k in range(num_stages) if k % world == rank]
    pipeline = [PipelineStage(stages[k], k, num_stages, torch.device("cpu")) for k in mine]
    # Each microbatch's loss is a mean over its tokens; the schedule divides the summed gradients by the
    # number of microbatches (scale_grads), which makes them the global batch's.
    runner = getattr(schedules, schedule)(pipeline if stages_per_rank > 1 else pipeline[0], n_microbatches=microbatches,
                                          loss_fn=loss_of)
    parameters = [p for k in mine for p in stages[k].parameters()]
    optimizer = torch.optim.SGD(list({id(p): p for p in parameters}.values()), lr=LR)
    for step in range(STEPS):
        ids, targets = batch(step)
        optimizer.zero_grad()
        # As torch 2.11 takes them: the first stage's inputs contiguous (its PipelineStage checks their strides
        # against a contiguous copy) and no inputs on the other ranks (a None would reach a later stage of
        # ScheduleGPipe and Schedule1F1B as an input).
        inputs = (ids.contiguous(),) if rank == 0 else ()
        runner.step(*inputs, target=targets if rank == (num_stages - 1) % world else None)
        optimizer.step()
    names = {id(p): name for name, p in net.named_parameters()}
    owned = {names[id(p)]: p.detach().clone() for p in parameters}
    sent = [stages[k].sent_bytes for k in mine]
    return owned, sent


def check_tensor_parallel(rank, want):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from attnres_fx.models import build_hf

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for name in ("single", "parallel"):
        torch.manual_seed(0)
        llama = build_hf("llama")
        ids = torch.randint(0, llama.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))
        attnres_fx.attnresify(llama, (ids,), block_size=1)
        randomise_pseudo_queries(llama)
        llama.train()
        if name == "parallel":
            plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                    "mlp.down_proj": RowwiseParallel()}
            for layer in llama.model.layers:
                parallelize_module(layer, mesh, plan)
        optimizer = torch.optim.SGD(llama.parameters(), lr=LR)
        for _ in range(STEPS):
            optimizer.zero_grad()
            llama(ids, labels=ids).loss.backward()
            optimizer.step()
        results[name] = full_parameters(llama)
    return relative_gap(results["parallel"], results["single"])


def _run(name, function, *args, **kwargs):
    try:
        return {"ok": True, "value": function(*args, **kwargs)}
    except Exception as err:  # noqa: BLE001 - the test reports it
        return {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:],
                "typed": isinstance(err, attnres_fx.AttnResError)}


def _worker(rank, world, store, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    want = reference()
    results = {
        "ddp": _run("ddp", check_ddp, rank, want),
        "fsdp": _run("fsdp", check_fsdp_per_block, rank, want),
        "fsdp_keep": _run("fsdp_keep", check_fsdp_per_block, rank, want, reshard_after_forward=False),
        "fsdp_bf16": _run("fsdp_bf16", check_fsdp_per_block, rank, reference_bf16(), mp_policy=True),
        "fsdp_checkpoint": _run("fsdp_checkpoint", check_fsdp_per_block, rank, want, checkpoint=True),
        "fsdp_reentrant": _run("fsdp_reentrant", check_fsdp_reentrant_wrapper, rank, want),
        "hf_checkpointing": _run("hf_checkpointing", check_hf_gradient_checkpointing, rank),
        "fsdp_checkpoint_compile": _run("fsdp_checkpoint_compile", check_fsdp_per_block, rank, reference(2),
                                        checkpoint=True, compile_blocks=True, layers=2),
        "user_block_compile": _run("user_block_compile", check_user_block_compile, rank, want),
        "gpipe": _run("gpipe", check_pipeline, rank, want, "ScheduleGPipe"),
        "1f1b": _run("1f1b", check_pipeline, rank, want, "Schedule1F1B"),
        "interleaved": _run("interleaved", check_pipeline, rank, want, "ScheduleInterleaved1F1B", stages_per_rank=2),
        "interleaved_cached": _run("interleaved_cached", check_pipeline, rank, want, "ScheduleInterleaved1F1B",
                                   stages_per_rank=2, cached=True),
        "tensor_parallel": _run("tensor_parallel", check_tensor_parallel, rank, want),
        "reference": want,
    }
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "store"), tmp), nprocs=2, join=True)
        return [torch.load(f"{tmp}/rank{r}.pt", weights_only=False) for r in range(2)]


def _value(ranks, key, rank=0):
    result = ranks[rank][key]
    assert result["ok"], f"{key} failed on rank {rank}: {result['error']}\n{result['trace']}"
    return result["value"]


# Each setup's largest relative parameter gap to the single-process run, after the same steps; 1e-6 where
# only the reduction order of fp32 sums differs.
@pytest.mark.parametrize("key, tolerance", [
    ("ddp", 1e-6),
    # ``fully_shard`` on every block and then the root, resharding after forward or not.
    ("fsdp", 1e-6),
    ("fsdp_keep", 1e-6),
    # bf16 parameters and compute, fp32 gradient reduction: bf16's rounding of the parameter change.
    ("fsdp_bf16", 2e-2),
    # torchtitan's order: ``checkpoint_wrapper`` (non-reentrant) per block, then ``fully_shard``.
    ("fsdp_checkpoint", 1e-6),
    # Reentrant checkpointing recomputes a block on a detached copy of its input: the block's state is found
    # again by its storage, and the gradients meet where they would have.
    ("fsdp_reentrant", 1e-6),
    ("hf_checkpointing", 1e-6),
    # Checkpointing, ``attnres_fx.compile`` (each block's rewritten graph through Inductor), then
    # ``fully_shard`` per block and root: Inductor's fused kernels reorder fp32 sums.
    ("fsdp_checkpoint_compile", 1e-5),
    # ``ColwiseParallel`` / ``RowwiseParallel`` on a Llama's projections (DTensor over gloo), the AttnRes
    # parameters replicated: the sharded matmuls sum in another order.
    ("tensor_parallel", 1e-5),
])
def test_trains_as_one_process(ranks, key, tolerance):
    for rank in range(2):
        gap, name = _value(ranks, key, rank)
        assert gap < tolerance, (key, rank, name, gap)


def test_a_users_own_block_compile_says_what_to_use(ranks):
    outcome, message = _value(ranks, "user_block_compile")
    assert outcome == "typed" and "attnres_fx.compile" in message, (outcome, message)


@pytest.mark.parametrize("key", ["gpipe", "1f1b", "interleaved", "interleaved_cached"])
def test_pipeline_stages_train_as_one_process(ranks, key):
    """Every rank's stage parameters after 3 steps equal the single-process run's."""
    want = ranks[0]["reference"]
    covered = set()
    for rank in range(2):
        owned, _ = _value(ranks, key, rank)
        gap, name = relative_gap(owned, {name: want[name] for name in owned})
        assert gap < 1e-6, (key, rank, name, gap)
        covered |= set(owned)
    assert covered == set(want), f"parameters no stage trains: {set(want) - covered}"


def test_cross_stage_caching_sends_fewer_bytes(ranks):
    for rank in range(2):
        _, plain = _value(ranks, "interleaved", rank)
        _, cached = _value(ranks, "interleaved_cached", rank)
        assert sum(cached) < sum(plain), (rank, plain, cached)

