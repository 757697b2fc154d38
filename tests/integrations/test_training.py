"""Training helpers: optimizer groups, the frozen warm-up (eager and Inductor), and the depth monitor as a
plain function and as a Hugging Face Trainer callback."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import attnres_fx
from attnres_fx.models import TinyTransformer, example_ids
from conftest import cold_compile, hooks_of

LR = 1e-2


def tiny(converted=True):
    torch.manual_seed(0)
    model = TinyTransformer(num_layers=2, dim=32).train()
    if converted:
        attnres_fx.attnresify(model, (example_ids(model.config),), block_size=2)
    return model


def attnres_names(model):
    return {f"{site.name}.{leaf}" for site in attnres_fx.sites(model) for leaf in ("proj.weight", "norm.weight")}


def train_step(model, optimizer, seed=0):
    ids = example_ids(model.config, batch=4, seq=16, seed=seed)
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def state(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def changed(before, model):
    return {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}


# -- param_groups -----------------------------------------------------------------------------------------

def test_param_groups_separate_attnres_parameters_with_their_own_rate_and_decay():
    model = tiny()
    groups = attnres_fx.param_groups(model, lr=3e-3, weight_decay=0.1, attnres_lr_mult=1.5,
                                     attnres_weight_decay=1e-4)
    names = {id(p): name for name, p in model.named_parameters()}
    members = {g["name"]: {names[id(p)] for p in g["params"]} for g in groups}
    assert [(g["name"], g["lr"], g["weight_decay"]) for g in groups] == [
        ("decay", 3e-3, 0.1), ("no_decay", 3e-3, 0.0), ("attnres_queries", 3e-3 * 1.5, 1e-4),
        ("attnres_norms", 3e-3 * 1.5, 0.0)]
    assert members["attnres_queries"] | members["attnres_norms"] == attnres_names(model)
    assert all(name.endswith("proj.weight") for name in members["attnres_queries"])
    dims = {name: p.dim() for name, p in model.named_parameters()}
    assert all(dims[name] == 1 for name in members["no_decay"]) and all(dims[name] == 2 for name in members["decay"])
    assert "blocks.0.ln1.weight" in members["no_decay"] and "blocks.0.attn.qkv.bias" in members["no_decay"]
    assert {"tok_emb.weight", "head.weight", "blocks.1.mlp.fc2.weight"} <= members["decay"]
    everything = [name for group in members.values() for name in group]
    assert sorted(everything) == sorted(names.values()), "every parameter in exactly one group"


def test_a_baseline_gets_the_same_call_without_attnres_groups():
    groups = attnres_fx.param_groups(tiny(converted=False), lr=1e-3, weight_decay=0.1)
    assert [g["name"] for g in groups] == ["decay", "no_decay"]


def test_the_multiplier_holds_through_a_schedule_and_decay_spares_the_attnres_parameters():
    model = tiny()
    with torch.no_grad():
        for site in attnres_fx.sites(model):
            model.get_submodule(site.name).proj.weight.fill_(0.5)
    optimizer = torch.optim.AdamW(attnres_fx.param_groups(model, lr=LR, weight_decay=0.5))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    for _ in range(3):
        scheduler.step()
    rates = {g["name"]: g["lr"] for g in optimizer.param_groups}
    assert rates["attnres_queries"] == pytest.approx(2 * rates["decay"]) and rates["decay"] == pytest.approx(LR / 4)
    # With zero gradients AdamW moves a parameter by its weight decay only.
    before = state(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    moved = changed(before, model)
    assert not moved & attnres_names(model) and "head.weight" in moved and "blocks.0.ln1.weight" not in moved


@pytest.mark.parametrize("kwargs", [{"lr": 0.0, "weight_decay": 0.1}, {"lr": 1e-3, "weight_decay": -1.0},
                                    {"lr": 1e-3, "weight_decay": 0.1, "attnres_lr_mult": 0},
                                    {"lr": 1e-3, "weight_decay": 0.1, "attnres_weight_decay": float("nan")}])
def test_param_groups_refuse_bad_rates(kwargs):
    name = next(k for k, v in kwargs.items() if v in (0.0, -1.0, 0) or v != v)
    with pytest.raises(ValueError, match=name):
        attnres_fx.param_groups(tiny(converted=False), **kwargs)


# -- freeze / unfreeze ----------------------------------------------------------------------------------

def test_freeze_holds_the_attnres_parameters_while_the_rest_trains_and_unfreeze_releases_them():
    model = tiny()
    optimizer = torch.optim.AdamW(attnres_fx.param_groups(model, lr=LR, weight_decay=0.1))
    assert attnres_fx.freeze(model) is model
    assert all(not p.requires_grad for name, p in model.named_parameters() if name in attnres_names(model))
    before = state(model)
    for seed in range(2):
        train_step(model, optimizer, seed)
    moved = changed(before, model)
    assert not moved & attnres_names(model) and "head.weight" in moved
    assert attnres_fx.unfreeze(model) is model
    before = state(model)
    train_step(model, optimizer, 2)
    queries = {name for name in attnres_names(model) if name.endswith("proj.weight")}
    single_source = {f"{site.name}.proj.weight" for site in attnres_fx.sites(model) if site.num_sources == 1}
    assert changed(before, model) & queries == queries - single_source


@cold_compile
@pytest.mark.slow
def test_unfreeze_on_an_inductor_routed_model_trains_the_queries_again():
    # The compiled graphs were built while the queries did not require gradients; without a recompile
    # they would never get one. The suite's Inductor training compile: it also checks what eager training
    # checks (the loss falls, every query with more than one source moves, single-source ones cannot).
    model = attnres_fx.compile(attnres_fx.freeze(tiny()))
    optimizer = torch.optim.AdamW(attnres_fx.param_groups(model, lr=LR, weight_decay=0.0))
    train_step(model, optimizer)
    attnres_fx.unfreeze(model)
    before = state(model)
    losses = [train_step(model, optimizer, 1) for _ in range(3)]
    assert attnres_fx.conversion.conversion_of(model).compiler == "inductor"
    assert losses[-1] < losses[0], losses
    queries = {name for name in attnres_names(model) if name.endswith("proj.weight")}
    single_source = {f"{site.name}.proj.weight" for site in attnres_fx.sites(model) if site.num_sources == 1}
    assert single_source and changed(before, model) & queries == queries - single_source


def test_freeze_refuses_an_unconverted_model():
    for call in (attnres_fx.freeze, attnres_fx.unfreeze):
        with pytest.raises(ValueError, match="converted by attnres_fx.attnresify"):
            call(tiny(converted=False))


# -- monitor --------------------------------------------------------------------------------------------

def collapse(model, site_name, source, *inputs, **kwargs):
    """Make one site attend to ``source`` alone: a large pseudo-query along that source's mean key."""
    module = model.get_submodule(site_name)
    seen = {}
    handle = module.register_forward_pre_hook(lambda m, args: seen.__setitem__("sources", args))
    with torch.no_grad():
        model(*inputs, **kwargs)
        handle.remove()
        keys = [(s / s.pow(2).mean(-1, keepdim=True).sqrt()).reshape(-1, s.shape[-1]).mean(0) for s in seen["sources"]]
        direction = keys[source] - torch.stack(keys).mean(0)
        module.proj.weight.copy_(100 * direction / direction.norm() / module.norm.weight)


def test_monitor_depth_reports_entropy_and_max_weight_of_every_multi_source_site():
    model = tiny().eval()
    ids = example_ids(model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # uniform weights: no warning
        metrics = attnres_fx.monitor_depth(model, ids)
    weights = attnres_fx.depth_weights(model, ids)
    multi = [row for row in weights if row.site.num_sources > 1]
    assert set(metrics) == {f"attnres/{row.site.name}/{key}" for row in multi for key in ("entropy", "max_weight")}
    for row in multi:
        assert metrics[f"attnres/{row.site.name}/entropy"] == pytest.approx(row.entropy)
        assert metrics[f"attnres/{row.site.name}/max_weight"] == pytest.approx(1 / row.site.num_sources)


def test_monitor_depth_warns_when_a_site_collapses_onto_one_source():
    model = tiny().eval()
    collapse(model, "blocks.1.mlp_res", 1, example_ids(model.config))
    with pytest.warns(attnres_fx.AttnResWarning, match=r"collapsed onto one source: blocks\.1\.mlp_res -> b1"):
        metrics = attnres_fx.monitor_depth(model, example_ids(model.config), prefix="depth")
    assert metrics["depth/blocks.1.mlp_res/max_weight"] > 0.95
    assert metrics["depth/blocks.1.mlp_res/entropy"] < 0.2


def test_monitor_depth_refuses_a_threshold_outside_0_1():
    model = tiny().eval()
    with pytest.raises(ValueError, match="collapse_threshold"):
        attnres_fx.monitor_depth(model, example_ids(model.config), collapse_threshold=1.5)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, count, seq, vocab):
        self.ids = torch.randint(1, vocab, (count, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(model, monitor, tmp_path, steps=4):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, logging_steps=2, per_device_train_batch_size=2,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, learning_rate=LR)
    optimizer = torch.optim.AdamW(attnres_fx.param_groups(model, lr=LR, weight_decay=0.0))
    return Trainer(model=model, args=args, train_dataset=_Tokens(16, 12, 128), callbacks=[monitor],
                   optimizers=(optimizer, None))


@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from attnres_fx.models import build_hf, hf_example_inputs

    model = build_hf("llama")
    args, kwargs = hf_example_inputs("llama")
    return attnres_fx.attnresify(model, args, example_kwargs=kwargs, block_size=2), args


def test_trainer_callback_logs_the_metrics_of_the_monitored_steps(llama, tmp_path):
    model = copy.deepcopy(llama[0]).train()
    monitor = attnres_fx.depth_monitor_callback()
    trainer = _trainer(model, monitor, tmp_path)
    hooks = hooks_of(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", attnres_fx.AttnResWarning)
        trainer.train()
    assert [step for step, _ in monitor.history] == [2, 4], "every logging_steps"
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logged] == [2, 4]
    for (_, metrics), entry in zip(monitor.history, logged):
        assert metrics and all(entry[key] == value for key, value in metrics.items())
    # The queries trained: the weights moved off uniform.
    last = monitor.history[-1][1]
    sites = {site.name: site for site in attnres_fx.sites(model)}
    assert any(abs(last[f"attnres/{name}/max_weight"] - 1 / site.num_sources) > 1e-3
               for name, site in sites.items() if site.num_sources > 1)
    assert hooks_of(model) == hooks, "no hook left behind"


def test_trainer_callback_warns_when_a_site_collapses(llama, tmp_path):
    model, args = copy.deepcopy(llama[0]).train(), llama[1]
    name = next(site.name for site in attnres_fx.sites(model) if site.num_sources == 3)
    collapse(model, name, 0, *args)
    monitor = attnres_fx.depth_monitor_callback(every=1)
    with pytest.warns(attnres_fx.AttnResWarning, match=rf"collapsed onto one source at step 1: {name} -> "):
        _trainer(model, monitor, tmp_path, steps=1).train()
