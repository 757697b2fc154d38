import copy
import importlib.util
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

# Two threads per pytest worker: one each made the Inductor-compiled tests twice as slow on two cores.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Property tests (test_properties.py). "ci": derandomised (the same examples every run), few enough for
# `make test` to stay under a minute; "fuzz": `make fuzz`, many random examples. Examples convert models
# with TorchDynamo (seconds each), hence no deadline.
settings.register_profile("ci", max_examples=4, derandomize=True, database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", max_examples=400, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def snapshot(model: torch.nn.Module) -> dict:
    """Everything a call must leave untouched: state_dict (values, keys), parameter objects."""
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "params": [id(p) for p in model.parameters()],
        "modules": [(name, type(m)) for name, m in model.named_modules()],
    }


def hooks_of(model: torch.nn.Module) -> dict:
    """The forward hooks on every module of ``model`` (the conversion's own included)."""
    return {name: (list(m._forward_pre_hooks.values()), list(m._forward_hooks.values()))
            for name, m in model.named_modules()}


def assert_untouched(model: torch.nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert list(after["state"]) == list(before["state"]), "state_dict keys changed"
    for key, value in before["state"].items():
        assert torch.equal(after["state"][key], value), f"{key} changed"
    assert after["params"] == before["params"]
    assert after["modules"] == before["modules"], "module tree changed"


@pytest.fixture
def untouched():
    """Usage: check = untouched(model); ...; check()"""
    def factory(model):
        before = snapshot(model)
        probe = _probe_input(model)
        out_before = _run(model, probe)

        def check():
            assert_untouched(model, before)
            if probe is not None:
                assert torch.equal(_run(model, probe), out_before), "outputs changed"
        return check
    return factory


def _probe_input(model):
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "vocab_size") and hasattr(cfg, "max_seq_len"):
        return torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    return None


def _run(model, x):
    with torch.no_grad():
        return copy.deepcopy(model)(x) if x is not None else None


def converted(model: torch.nn.Module, *example_inputs, **options) -> torch.nn.Module:
    """``attnresify`` of a deep copy of ``model`` (conversion is in place; the original stays the
    reference). ``example_kwargs`` goes through ``options``."""
    import attnres_fx

    return attnres_fx.attnresify(copy.deepcopy(model), example_inputs or None, **options)


def load_script(path, name: str):
    """Import a script of ``benchmarks/`` (not a package) as module ``name``, once."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        # dataclasses resolve the module's string annotations through sys.modules.
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
