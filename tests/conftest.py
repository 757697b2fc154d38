import copy
import importlib.metadata
import importlib.util
import io
import os
import subprocess
import sys
import traceback

# Inductor's compiled kernels are kept between runs, per torch release (its cache key has the release too;
# the folder keeps releases apart for clearing one). Cold, the suite still passes: it only takes longer.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "attnres_fx",
    f"inductor-torch{importlib.metadata.version('torch')}"))

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

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


# Inductor's first compile of a model on a cold cache (a new machine, another torch release) takes minutes on
# two busy cores, seconds once its kernels are cached: such tests get longer than the 120 s default.
cold_compile = pytest.mark.timeout(360)
# torch.onnx's export of a decoder with its cache (and onnxruntime's decoding after it): 20-45 s on two quiet
# cores, several minutes beside other work.
cached_export = pytest.mark.timeout(300)


# Modules that may start a process in the fast tier: each builds a cache once per machine.
ONE_TIME_CACHE_BUILDERS = (os.path.join("torch", "utils", "cpp_extension.py"),
                           os.path.join("matplotlib", "font_manager.py"))


class TierError(AssertionError):
    """A test of the fast tier (unmarked) did what only the slow or integration tiers may."""


@pytest.fixture(autouse=True)
def _fast_tier_contract(request, monkeypatch):
    """The fast tier (``make test-fast``: unmarked tests) runs no Inductor compile and starts no process, so
    it stays the loop a developer runs after each edit; a test that needs either is marked ``slow`` (or
    ``integration``). One-time caches built on a machine's first run are the exception: the C++ kernel's
    build (``torch.utils.cpp_extension``, cached under ``~/.cache``) and matplotlib's font list (its
    ``font_manager`` asks ``fc-list`` once)."""
    if request.node.get_closest_marker("slow") or request.node.get_closest_marker("integration"):
        yield
        return
    name = request.node.nodeid
    real_popen = subprocess.Popen

    class FastTierPopen(real_popen):
        def __init__(self, *args, **kwargs):
            if not any(frame.filename.endswith(ONE_TIME_CACHE_BUILDERS) for frame in traceback.extract_stack()):
                raise TierError(f"{name} starts a process: mark it @pytest.mark.slow")
            super().__init__(*args, **kwargs)

    def no_inductor(*args, **kwargs):
        raise TierError(f"{name} compiles with Inductor: mark it @pytest.mark.slow")

    import torch._inductor.compile_fx as compile_fx

    monkeypatch.setattr(subprocess, "Popen", FastTierPopen)
    monkeypatch.setattr(compile_fx, "compile_fx", no_inductor)
    yield


def snapshot(model: torch.nn.Module) -> dict:
    """Everything a call must leave untouched: state_dict (values, keys), parameter objects, the module
    tree, every module's hooks and instance attributes (flags, a ``forward`` wrapper), the config, and
    whether ``torch.save`` takes the model."""
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "params": [id(p) for p in model.parameters()],
        "modules": [(name, type(m)) for name, m in model.named_modules()],
        "hooks": hooks_of(model),
        "attributes": {name: sorted(vars(m)) for name, m in model.named_modules()},
        "config": _config_of(model),
        "saves": saves(model),
    }


def hooks_of(model: torch.nn.Module) -> dict:
    """Every hook on every module of ``model`` (the conversion's own included): forward, pre-forward and
    backward hooks, in order."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
    return {name: tuple(list(getattr(m, kind).values()) for kind in kinds) for name, m in model.named_modules()}


def saves(model: torch.nn.Module) -> str:
    """``"yes"`` when ``torch.save`` takes ``model``, else why not."""
    try:
        torch.save(model, io.BytesIO())
    except Exception as err:  # noqa: BLE001 - any failure to pickle counts
        return f"{type(err).__name__}: {err}"
    return "yes"


def _config_of(model: torch.nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        return None
    return config.to_dict() if hasattr(config, "to_dict") else copy.deepcopy(vars(config))


def assert_untouched(model: torch.nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert list(after["state"]) == list(before["state"]), "state_dict keys changed"
    for key, value in before["state"].items():
        assert torch.equal(after["state"][key], value), f"{key} changed"
    assert after["params"] == before["params"]
    assert after["modules"] == before["modules"], "module tree changed"
    for name, hooks in before["hooks"].items():
        assert after["hooks"][name] == hooks, f"hooks of {name or '<root>'} changed"
    for name, attributes in before["attributes"].items():
        assert after["attributes"][name] == attributes, f"instance attributes of {name or '<root>'} changed"
    assert after["config"] == before["config"], "config changed"
    assert after["saves"] == before["saves"], f"torch.save: {before['saves']} before, {after['saves']} now"


@pytest.fixture
def untouched():
    """Usage: ``check = untouched(model, *inputs, **kwargs); ...; check()``: the state and the outputs on
    those inputs (by default a Hugging Face model's dummy inputs, or token ids for a model with a
    ``config.vocab_size``) are as they were. A model the fixture cannot make inputs for needs them
    given: every check compares outputs."""
    def factory(model, *inputs, **kwargs):
        before = snapshot(model)
        call = (inputs, kwargs) if inputs or kwargs else _probe_input(model)
        out_before = _run(model, call)

        def check():
            assert_untouched(model, before)
            assert _same(_run(model, call), out_before), "outputs changed"
        return check
    return factory


def _probe_input(model):
    from attnres_fx.capture.tracers import dummy_inputs

    found = dummy_inputs(model)
    if found is not None:
        return found
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "vocab_size"):
        return (torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1)),), {}
    raise AssertionError(f"untouched({type(model).__name__}): pass the inputs to compare its outputs on")


def _run(model, call):
    args, kwargs = call
    with torch.no_grad():
        return copy.deepcopy(model)(*args, **kwargs)


def _same(a, b) -> bool:
    import torch.utils._pytree as pytree

    left, right = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(left) == len(right) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(left, right))


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
