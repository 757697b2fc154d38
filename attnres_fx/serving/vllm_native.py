"""Converted folders on vLLM's own model implementations, the route taken where vLLM has one for the
folder's architecture that the plugin serves on (:data:`attnres_fx.compat.vllm.NATIVE_CLASSES`): vLLM's
class (``AttnResLlamaForCausalLM`` is vLLM's ``LlamaForCausalLM``), built as for the original folder, plus

- the AttnRes parameters of every planned site, registered under the names the converted model gives them
  (``model.layers.3.attn_res``) and loaded from the folder's safetensors by those names, before vLLM's
  class loads the rest;
- their declaration to vLLM's capture (``attnres::site_parameters``, :mod:`attnres_fx.routing.host`) when
  the module holding the first site runs;
- vLLM's backend wrapped: the graph its capture makes of the decoder is rewritten by the folder's saved plan
  before vLLM compiles it, the residual stream found in it by data flow and matched to the plan site by site
  in order (:func:`attnres_fx.passes.plan.match_in_order`), since vLLM's modules are not the converted
  model's (its Llama adds a sublayer's output to the stream inside the next layer's input norm).

Nothing is written per family: a class of vLLM's joins the table once its graph is seen to hold the stream.
Where vLLM makes no graph (``enforce_eager=True``) or splits the stream over pipeline stages, or where the
folder's record holds no plan (saved before format 4), the folder is served by the Transformers-backend
class (:mod:`.vllm_model`), whose layers carry the conversion themselves."""

from __future__ import annotations

import time

import torch
from vllm.logger import init_logger

from ..compat import vllm as compat_vllm
from ..errors import UnsupportedArchitectureError
from ..integrations.checkpoint import CONFIG_ATTRIBUTE, SavedConversion
from ..op.module import BlockAttnRes
from ..routing import host
from .vllm_plugin import NATIVE_PREFIX as PREFIX

logger = init_logger("vllm.attnres_fx")


def saved_plan(model_config):
    """The plan of the folder's saved conversion, or ``None`` where its record holds none."""
    folder = str(model_config.model)
    return SavedConversion.from_json(getattr(model_config.hf_config, CONFIG_ATTRIBUTE),
                                     f"{folder}/config.json", CONFIG_ATTRIBUTE).plan


def fallback_reason(vllm_config) -> str | None:
    """Why the folder is served on the Transformers backend instead, or ``None``."""
    if not compat_vllm.runs_compiled(vllm_config):
        return ("vLLM runs the model eager (enforce_eager=True or compilation mode NONE), and the rewrite of vLLM's "
                "own class is made on the graph vLLM's capture makes")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        return "pipeline parallelism splits the residual stream over stages, each graph holding part of it"
    plan = saved_plan(vllm_config.model_config)
    if plan is None:
        return "the folder's record holds no plan (saved by an older attnres_fx): save it again to serve it natively"
    if len(plan.streams) != 1:
        return f"the model has {len(plan.streams)} residual streams"
    return None


class _Native:
    """What the converted classes add to vLLM's own class (see the module docstring)."""

    def __new__(cls, *, vllm_config, prefix: str = ""):
        reason = fallback_reason(vllm_config)
        if reason is None:
            return super().__new__(cls)
        from . import vllm_model

        logger.info("%s: served on vLLM's Transformers backend: %s", vllm_config.model_config.model, reason)
        return vllm_model.transformers_class(vllm_config.model_config)(vllm_config=vllm_config, prefix=prefix)

    def __init__(self, *, vllm_config, prefix: str = ""):
        from .vllm_model import check_compilation

        check_compilation(vllm_config)
        self._attnres_folder = str(vllm_config.model_config.model)
        plan = saved_plan(vllm_config.model_config)
        with compat_vllm.backends_wrapped(vllm_config, lambda backend: self._rewriting(backend, plan)):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        sites = self._attnres_sites = plan.sites
        for site in sites:
            parent, _, attribute = site.name.rpartition(".")
            holder = self._attnres_holder(parent, site.name)
            module = BlockAttnRes(plan.streams[site.stream].dim, plan.eps, preserve_scale=plan.preserve_scale)
            module.site = site
            holder.register_module(attribute, module)
        # vLLM compiles the decoder's forward, not its call: the declaration runs in a hook of a module it calls.
        first = self._attnres_holder(sites[0].name.rpartition(".")[0], sites[0].name)
        first.register_forward_pre_hook(lambda module, args: host.declare(self, sites))

    def load_weights(self, weights):
        """vLLM's loading, the AttnRes weights taken out of the stream and copied here: vLLM's class may rename
        what it loads (Mistral's maps any ``norm`` to ``model.norm``), and they are the converted model's."""
        own = dict(self.named_parameters())
        own = {name: own[name] for site in self._attnres_sites for name in
               (f"{site.name}.proj.weight", f"{site.name}.norm.weight")}
        loaded = set()

        def others():
            for name, tensor in weights:
                if name not in own:
                    yield name, tensor
                    continue
                with torch.no_grad():
                    own[name].copy_(tensor)
                loaded.add(name)
        loaded |= set(super().load_weights(others()))
        return loaded

    def _attnres_holder(self, path: str, site: str) -> torch.nn.Module:
        try:
            return self.get_submodule(path)
        except AttributeError:
            raise UnsupportedArchitectureError(
                f"{self._attnres_folder}: the converted model holds AttnRes site {site} in {path}, which vLLM's "
                f"{type(self).__mro__[2].__name__} does not have; serve it with model_impl='transformers'") from None

    def _rewriting(self, backend, plan):
        """``backend`` (what vLLM compiles the decoder's graph with) after the AttnRes rewrite of the graph."""
        name = type(self).__name__

        def compile_graph(graph, example_inputs):
            start = time.perf_counter()
            graph = host.rewritten_by(plan, graph, name, f"{self._attnres_folder} (vLLM's graph of {name})",
                                      in_order=True)
            compiled = backend(graph, example_inputs)
            logger.info("%s: vLLM's graph of the decoder (its own %s) compiled with AttnRes in %.1f s",
                        self._attnres_folder, name[len(PREFIX):], time.perf_counter() - start)
            return compiled
        return compile_graph


def __getattr__(name: str):
    # vLLM's registry imports a registered class by module and name: each is made when first asked for.
    architecture = name[len(PREFIX):]
    if not name.startswith(PREFIX) or architecture not in compat_vllm.NATIVE_CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    made = type(name, (_Native, compat_vllm.native_class(architecture)),
                {"__module__": __name__, "__qualname__": name,
                 "__doc__": f"vLLM's {architecture} serving a converted folder (see the module docstring)."})
    globals()[name] = made
    return made
