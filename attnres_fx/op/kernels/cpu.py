"""Build and load the C++ CPU kernel (``cpu.cpp``): once per machine, at first use.

The library is built with ``torch.utils.cpp_extension`` (a C++ compiler and ``ninja``; ``pip install
'attnres-fx[kernels]'`` brings ninja) into ``$ATTNRES_FX_KERNEL_CACHE`` (default
``~/.cache/attnres_fx/kernels``), under a name that hashes the source, the torch version and the
instruction set, so that a change of any of them builds anew and an unchanged one loads in
milliseconds, without compiler or ninja. Building prints one line and takes about a minute.

Where it cannot be built (no compiler, no ninja, a compile error), :func:`available` is False and
warns once, saying why; :mod:`attnres_fx.op.ops` then runs the PyTorch formulation, the same function.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from attnres_fx import compat
from attnres_fx.errors import AttnResWarning

SOURCE = Path(__file__).with_name("cpu.cpp")
CACHE_ENV = "ATTNRES_FX_KERNEL_CACHE"
DEFAULT_CACHE = Path.home() / ".cache" / "attnres_fx" / "kernels"
# What at::vec compiles to: the instruction set ATen itself dispatches to on this machine, with the
# macro that selects its Vectorized<float> specialisation (the flags Inductor's C++ backend uses too).
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
}
_BUILT = "built"            # written beside the library once it built: the cache holds a whole library


class _State:
    loaded: bool | None = None
    aggregate = None
    reason: str | None = None


class Entries:
    """The library's entries for Python callers, once it is loaded (``None`` before, and where it cannot be).

    ``run_site(site_class, module, entered, sources)``: what :func:`attnres_fx.op.module.run_site` does where
    nothing but the operator is needed (``module`` exactly ``site_class``, no hooks, plain CPU tensors, no
    ``__torch_function__`` mode), in C; else ``None``, and the caller takes its Python path. TorchDynamo traces
    it as :func:`_run_site_traced`, which always returns ``None``: the Python path, whose plain ops Inductor fuses.

    ``run_site_normed(site_class, module, entered, sources, norm, norm_class, norm_forward, weight_name,
    eps_name, weight_offset, bias_name, centred)``: :func:`attnres_fx.op.module.site_normed`'s operator call
    (with gradients recorded, one node for both, the weight's ``+ weight_offset`` a node of its own where not
    0.0; ``centred``: a layer norm, with the bias ``bias_name`` unless None), where both modules would run as
    matched; else ``None`` (and under TorchDynamo, as ``run_site``).

    ``bundle(state, carrier, tensors)``, ``unbundle(state, carrier, tensors)``, ``add_grads(holder, grads)``,
    ``take_grads(holder, count)``: the stream's autograd edges as C++ nodes, for
    :mod:`attnres_fx.routing.state` (which says what they do); ``bundle`` and ``unbundle`` return ``None``
    where an argument is not a plain tensor. Not for TorchDynamo's traces (the caller checks).

    ``deposit_counts()``: how many gradients the nodes have deposited, and how many sums a site's backward
    kernel wrote over in place, since the library was loaded (Note [gradient deposits] in ``cpu.cpp``).
    """
    run_site = None
    run_site_normed = None
    bundle = None
    unbundle = None
    add_grads = None
    take_grads = None
    deposit_counts = None


def _run_site_traced(site_class, module, entered, sources):
    return None


def _run_site_normed_traced(site_class, module, entered, sources, norm, norm_class, norm_forward, weight_name,
                            eps_name, weight_offset, bias_name, centred):
    return None


def available() -> bool:
    """Whether the C++ kernel is loaded: built (or loaded from the cache) at the first call; if that
    fails, False with one :class:`~attnres_fx.AttnResWarning` saying why."""
    if _State.loaded is None:
        try:
            library = _load()
            library.configure(compat.MODULE_HOOK_ATTRIBUTES, compat.global_module_hook_dicts())
            torch.compiler.substitute_in_graph(library.run_site, skip_signature_check=True)(_run_site_traced)
            torch.compiler.substitute_in_graph(library.run_site_normed,
                                               skip_signature_check=True)(_run_site_normed_traced)
            _State.aggregate, Entries.run_site = library.aggregate, library.run_site
            Entries.run_site_normed = library.run_site_normed
            Entries.bundle, Entries.unbundle = library.bundle, library.unbundle
            Entries.add_grads, Entries.take_grads = library.add_grads, library.take_grads
            Entries.deposit_counts = library.deposit_counts
            _State.loaded = True
        except _Unavailable as err:
            _State.loaded, _State.reason = False, str(err)
            warnings.warn(f"attnres_fx: the C++ CPU kernel is not available ({err}); the aggregation runs as "
                          "PyTorch ops, the same function, slower.", AttnResWarning, stacklevel=3)
    return _State.loaded


def loaded() -> bool:
    """:func:`available`, once it has been asked: one attribute read on the hot path."""
    return _State.loaded if _State.loaded is not None else available()


def aggregate_op():
    """Where :func:`available`, a function that calls the operator ``attnres_cpu::aggregate`` as
    ``torch.ops.attnres_cpu.aggregate`` does (through the dispatcher: autograd, dispatch modes), for plain
    tensors only: no ``__torch_function__`` (check :func:`torch.overrides.has_torch_function` first), and
    without converting each argument against the schema (some 10 us with cold caches, per aggregation of a
    decoding step); else ``None``."""
    return _State.aggregate if _State.loaded is not None else (available() and _State.aggregate)


def unavailable_reason() -> str | None:
    """Why :func:`available` returned False (``None`` when it was not asked, or the kernel loaded)."""
    return _State.reason


class _Unavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def _flags() -> list[str]:
    # OpenMP: at::parallel_for is inline, and without -fopenmp its pragma compiles to a serial loop.
    return ["-O3", "-fopenmp", *_ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])]


def library_name() -> str:
    digest = hashlib.sha256("\0".join([SOURCE.read_text(), torch.__version__, *_flags()]).encode()).hexdigest()
    return f"attnres_cpu_{digest[:16]}"


def _load():
    """Build the library where its cache has none; load it (registering the operators) and return it as a
    Python module (its entry for :func:`aggregate_op`)."""
    name = library_name()
    directory = cache_dir() / name
    library = directory / f"{name}.so"
    if not ((directory / _BUILT).exists() and library.exists()):
        _build(name, directory)
    torch.ops.load_library(str(library))
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    loader.exec_module(module)
    return module


def _build(name: str, directory: Path) -> None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise _Unavailable(f"no C++ compiler: {compiler!r} (the CXX environment variable, else c++) is not found")
    if not cpp_extension.is_ninja_available():
        raise _Unavailable("ninja is not installed (pip install 'attnres-fx[kernels]')")
    directory.mkdir(parents=True, exist_ok=True)
    print(f"attnres_fx: building the C++ CPU kernel for this machine, once (about a minute), in {directory}",
          file=sys.stderr, flush=True)
    try:
        cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=_flags(), extra_ldflags=["-fopenmp"],
                           build_directory=str(directory), is_python_module=False, verbose=False)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
        lines = str(err).splitlines()
        first = next((line for line in lines if "error" in line.lower() and "Error building" not in line),
                     lines[0] if lines else type(err).__name__)
        raise _Unavailable(f"building it in {directory} failed: {first}") from err
    (directory / _BUILT).write_text(name)

