"""Converted models under torch.distributed: DDP and FSDP2, two CPU processes over gloo."""

import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attnres_fx

sys.path.insert(0, os.path.dirname(__file__))

STEPS = 3


def _setup(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _model():
    from toy_models import NanoGPT, make_inputs

    torch.manual_seed(0)
    model = NanoGPT(dropout=0.0).train()
    model.wpe.weight.requires_grad_(False)          # computed under no_grad: never gets a gradient
    return attnres_fx.attnresify(model, (make_inputs(),), block_size=2), make_inputs


def _train(model, make_inputs, rank):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        # Each rank sees its own batch: only gradient averaging keeps the replicas equal.
        _, loss = model(make_inputs(batch=2, seq=8, seed=10 * step + rank), make_inputs(seed=10 * step + rank + 5))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _ddp_worker(rank: int, world: int, store: str, out: str) -> None:
    _setup(rank, world, store)
    model, make_inputs = _model()
    initial = model.h[1].mlp_res.proj.weight.detach().clone()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    _train(ddp, make_inputs, rank)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"state": state, "moved": not torch.equal(initial, model.h[1].mlp_res.proj.weight)},
               f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def _fsdp_worker(rank: int, world: int, store: str, out: str, per_layer: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    _setup(rank, world, store)
    model, make_inputs = _model()
    try:
        if per_layer:
            for layer in model.h:
                fully_shard(layer)
        fully_shard(model)
        _train(model, make_inputs, rank)
        result = {"ok": True, "loss_finite": True}
    except attnres_fx.AttnResError as err:
        result = {"ok": False, "typed": True, "message": str(err)}
    except Exception as err:  # noqa: BLE001 - the test reports what happened
        result = {"ok": False, "typed": False, "message": f"{type(err).__name__}: {err}"}
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def _spawn(worker, *args):
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(worker, args=(2, store, tmp, *args), nprocs=2, join=True)
        return [torch.load(f"{tmp}/rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
def test_ddp_training_keeps_every_rank_identical_pseudo_queries_included():
    ranks = _spawn(_ddp_worker)
    assert all(r["moved"] for r in ranks), "the pseudo-queries trained"
    for key, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][key]), key
    assert any("_res." in key for key in ranks[0]["state"])


@pytest.mark.slow
def test_fsdp2_on_the_root_trains():
    for result in _spawn(_fsdp_worker, False):
        assert result["ok"], result["message"]


@pytest.mark.slow
def test_fsdp2_per_layer_raises_a_typed_error_saying_why():
    for result in _spawn(_fsdp_worker, True):
        assert not result["ok"] and result["typed"], result["message"]
        assert "fully_shard" in result["message"] and "Shard the root module only" in result["message"]
