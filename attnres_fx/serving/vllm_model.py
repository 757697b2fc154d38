"""The classes vLLM serves a converted folder with (registered by :mod:`.vllm_plugin`): vLLM's
Transformers backend, which builds the Hugging Face model from ``config.json`` and runs it with vLLM's
attention, paged KV cache and layers, with the model converted by attnres_fx from the config's
``"attnres"`` entry as it is built. The conversion finds the residual streams by data flow, as for any
model, so every family the backend serves is served converted; the AttnRes weights load with the others
from the folder's safetensors.

vLLM's default, compiled path captures the decoder's forward as one TorchDynamo graph, dynamic on the token
count, and compiles it with its backend (Inductor on the CPU; its piecewise backend, split at the attention
ops, on GPUs). The converted decoder takes that path as a host capture (:mod:`attnres_fx.routing.host`):
its layers run as written while vLLM traces them and declare their AttnRes parameters, and vLLM's backend
is wrapped so that each graph it gets is first rewritten by the conversion's plan, the streams found in
vLLM's graph by data flow, the aggregations as plain ops its compiler fuses. With ``enforce_eager=True``
the layers take attnres_fx's eager layer route instead.

AttnRes mixes each token's own hidden states over depth, so it adds no state to the KV cache: continuous
batching, chunked prefill and prefix caching see the model they see without it."""

from __future__ import annotations

import time

import torch
from vllm.logger import init_logger
from vllm.sequence import IntermediateTensors
from vllm.model_executor.models.transformers import TransformersForCausalLM, TransformersMoEForCausalLM

from .. import api
from ..integrations import hf
from ..conversion import plan_of
from ..compat import vllm as compat_vllm
from .. import routing
from ..routing import host
from ..errors import CheckpointMismatchError, UnsupportedArchitectureError

# Under vLLM's logger, whose handlers print its processes' INFO lines (a logger outside it prints only warnings).
logger = init_logger("vllm.attnres_fx")


class _Converted:
    """What the converted classes add to vLLM's Transformers-backend classes."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        check_compilation(vllm_config)
        # The decoder's compiled forward is made while the Hugging Face model is built, before it is converted:
        # its backend rewrites each graph with the conversion the model has by the time it is compiled.
        with compat_vllm.backends_wrapped(vllm_config, self._rewriting):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.stage = _Stage(self.model, str(self.model_config.model)) if self.pp_group.world_size > 1 else None
        if self.stage is not None:
            self.make_empty_intermediate_tensors = compat_vllm.intermediate_tensors_factory(
                ["hidden_states", *self.stage.received], self.text_config.hidden_size)
            if compat_vllm.never_compile(self.model):
                logger.warning("%s: a pipeline stage runs the converted decoder eager: its graph would hold part of "
                               "the residual stream, whose block sums it takes from and hands to the other stages; "
                               "vLLM's capture takes no inputs or outputs besides the hidden states",
                               self.model_config.model)

    def _rewriting(self, backend):
        """``backend`` (what vLLM compiles the decoder's graph with) after the AttnRes rewrite of the graph."""
        rewriting = host.rewriting_backend(lambda: self.model, backend)

        def compile_graph(graph, example_inputs):
            start = time.perf_counter()
            compiled = rewriting(graph, example_inputs)
            logger.info("%s: vLLM's graph of the decoder compiled with AttnRes in %.1f s", self.model_config.model,
                        time.perf_counter() - start)
            return compiled
        return compile_graph

    def _create_hf_to_vllm_mapper(self):
        # The first step after the Hugging Face model is built: it is converted here, while its layers are
        # still its own (vLLM's replace them next) and before the weight-name mapper lists its children,
        # final_res among them.
        _convert(self.model, self.text_config, self.config.attnres, str(self.model_config.model))
        host.host(self.model, "vLLM")
        super()._create_hf_to_vllm_mapper()

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        if self.stage is not None and intermediate_tensors is not None:
            self.stage.enter(self.model, intermediate_tensors)
        hidden = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        if self.stage is not None and isinstance(hidden, IntermediateTensors):
            self.stage.leave(self.model, hidden)
        return hidden


class AttnResForCausalLM(_Converted, TransformersForCausalLM):
    """A converted decoder: ``TransformersForCausalLM`` with the AttnRes conversion."""


class AttnResMoEForCausalLM(_Converted, TransformersMoEForCausalLM):
    """A converted mixture of experts: ``TransformersMoEForCausalLM`` with the AttnRes conversion."""


def transformers_class(model_config) -> type:
    """The converted class on the Transformers backend vLLM would serve ``model_config`` with."""
    from .vllm_plugin import ARCHITECTURES

    return globals()[ARCHITECTURES[compat_vllm.transformers_backend_class(model_config)][0]]


class _Stage:
    """This process's pipeline stage of the stream: where its first block begins (``entry``, residual site;
    ``None`` on the first stage) and the block sums it receives there, as ``IntermediateTensors`` keys
    (``received``) beside vLLM's ``hidden_states`` (the carrier: the plain residual sum), then the partial
    sum; the same keys for what it hands on where the next stage begins. vLLM runs the model under
    ``torch.inference_mode()``, where a view does not know the tensor it was made from: the carrier is found
    as the stage's last block returned it (``left``, set by a hook on that block) and handed to the first
    one with its batch dimension (the backend adds one only to a tensor that has none)."""

    def __init__(self, model: torch.nn.Module, folder: str):
        plan = plan_of(model)
        if len(plan.streams) != 1 or plan.streams[0].route != "layer":
            raise UnsupportedArchitectureError(
                f"{folder}: pipeline parallelism hands one residual stream on the layer route from stage to stage; "
                f"this model has {len(plan.streams)} stream(s), routes {plan.routes}")
        planned = plan.streams[0]
        # vLLM replaced the blocks of the other stages (their routed modules are gone).
        here = [span for span in planned.layers if routing.is_routed(model.get_submodule(span.owner))]
        self.stream = planned.index
        self.entry = here[0].start if here[0].start > 0 else None
        blocks = planned.completed_before(self.entry) if self.entry is not None else 0
        self.received = (*(f"attnres_block_{k}" for k in range(blocks)), "attnres_partial") if blocks else ()
        self.left: list[torch.Tensor] = []
        if here[-1].stop < planned.num_positions:
            model.get_submodule(here[-1].owner).register_forward_hook(
                lambda module, args, output: self.left.append(output))

    def enter(self, model: torch.nn.Module, received: IntermediateTensors) -> None:
        """Attach the state received to the carrier the decoder takes."""
        if self.entry is None:
            return
        carrier = received.tensors["hidden_states"] = received["hidden_states"][None]
        tensors = [received[key][None] for key in self.received]
        routing.enter_stream(model, self.stream, carrier, self.entry, tensors[:-1], tensors[-1])

    def leave(self, model: torch.nn.Module, handed: IntermediateTensors) -> None:
        """Add the stream's state, which the last block of this stage left on its carrier, to what vLLM hands
        the next stage."""
        blocks, partial = routing.stream_state(model, self.stream, self.left.pop())
        self.left.clear()
        keys = (*(f"attnres_block_{k}" for k in range(len(blocks))), "attnres_partial")
        handed.tensors.update({key: tensor[0] for key, tensor in zip(keys, (*blocks, partial))})


def check_compilation(vllm_config) -> None:
    if compat_vllm.compiles_whole_model(vllm_config):
        raise UnsupportedArchitectureError(
            f"{vllm_config.model_config.model}: compilation mode STOCK_TORCH_COMPILE compiles the whole vLLM model "
            "with a backend the attnres_fx plugin does not see, so the AttnRes rewrite could not be applied. Use "
            "vLLM's default compilation mode, or enforce_eager=True.")


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
