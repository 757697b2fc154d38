"""The classes vLLM serves a converted folder with (registered by :mod:`.vllm_plugin`): vLLM's
Transformers backend, which builds the Hugging Face model from ``config.json`` and runs it with vLLM's
attention, paged KV cache and layers, with the model converted by attnres_fx from the config's
``"attnres"`` entry as it is built. The conversion finds the residual streams by data flow, as for any
model, so every family the backend serves is served converted; the AttnRes weights load with the others
from the folder's safetensors.

vLLM's compiled path (its ``torch.compile`` capture of the whole decoder as one graph) cannot take a
converted model: attnres_fx routes each block's call through its own rewritten graph, which a single-graph
capture reaches as :class:`~attnres_fx.ForeignCompileError`. The converted classes run eager instead, with a
warning (what ``enforce_eager=True`` asks for).

AttnRes mixes each token's own hidden states over depth, so it adds no state to the KV cache: continuous
batching, chunked prefill and prefix caching see the model they see without it."""

from __future__ import annotations

import torch
from vllm.logger import init_logger
from vllm.model_executor.models.transformers import TransformersForCausalLM, TransformersMoEForCausalLM

from .. import api
from ..integrations import hf
from ..conversion import plan_of
from ..compat import vllm as compat_vllm
from ..errors import CheckpointMismatchError, UnsupportedArchitectureError

logger = init_logger(__name__)


class _Converted:
    """What the converted classes add to vLLM's Transformers-backend classes."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        _check_parallelism(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)

    def _decorate_for_torch_compile(self):
        # The decoder class is left undecorated: vLLM's capture would take the converted forward as one graph.
        if compat_vllm.compiles(self.vllm_config):
            logger.warning("%s: the converted model runs eager. vLLM's torch.compile capture takes the decoder's "
                           "forward as one graph (fullgraph), which attnres_fx's per-block routing cannot join "
                           "(ForeignCompileError); pass enforce_eager=True to silence this.", self.model_config.model)

    def _create_hf_to_vllm_mapper(self):
        # The first step after the Hugging Face model is built: it is converted here, while its layers are
        # still its own (vLLM's replace them next) and before the weight-name mapper lists its children,
        # final_res among them.
        _convert(self.model, self.text_config, self.config.attnres, str(self.model_config.model))
        # The class may have been decorated by a plain model built earlier in this process.
        compat_vllm.never_compile(self.model)
        super()._create_hf_to_vllm_mapper()


class AttnResForCausalLM(_Converted, TransformersForCausalLM):
    """A converted decoder: ``TransformersForCausalLM`` with the AttnRes conversion."""


class AttnResMoEForCausalLM(_Converted, TransformersMoEForCausalLM):
    """A converted mixture of experts: ``TransformersMoEForCausalLM`` with the AttnRes conversion."""


def _check_parallelism(vllm_config) -> None:
    parallel = vllm_config.parallel_config
    sizes = {"pipeline_parallel_size": parallel.pipeline_parallel_size,
             "tensor_parallel_size": parallel.tensor_parallel_size}
    wider = {name: size for name, size in sizes.items() if size > 1}
    if wider:
        raise UnsupportedArchitectureError(
            f"{vllm_config.model_config.model}: the attnres_fx plugin serves a converted model in one process "
            f"({', '.join(f'{k}={v}' for k, v in wider.items())} asked): a pipeline stage would need the "
            "completed block sums of the stages before it. Serve it with both sizes 1.")


def _convert(model: torch.nn.Module, text_config, entry: dict, folder: str) -> None:
    """Convert the backend's Hugging Face model as its folder was converted, with the saved options."""
    options = hf.check_entry(entry, f"{folder}/config.json", hf.CONFIG_ATTRIBUTE)
    serving_attention = text_config._attn_implementation
    # The conversion's capture calls the model once; vLLM's attention runs only inside a forward pass of
    # the engine, so the capture runs the Hugging Face model's own (the graph it records is the same).
    text_config._attn_implementation = "sdpa"
    try:
        api.attnresify(model, config=options)
    finally:
        text_config._attn_implementation = serving_attention
    if list(plan_of(model).block_sizes) != list(entry["block_sizes"]):
        sizes = list(plan_of(model).block_sizes)
        api.remove(model)
        raise CheckpointMismatchError(f"{folder}: saved with AttnRes block sizes {entry['block_sizes']}, the model "
                                      f"vLLM builds from its config converts to {sizes}")
