"""What the tests and benchmarks check converted models against; the package itself never imports this.

- :mod:`attnres_fx.testing.reference`: a plain-PyTorch Block AttnRes written from the method's
  pseudo-code, sharing no code with the passes (the oracle);
- :data:`EXPECTED`: for each tiny Hugging Face model of :data:`attnres_fx.models.HF_MODELS`, the
  streams, layers and norms detection must find;
- :func:`lm_loss`, a training loss for every tiny model, and :func:`randomise_pseudo_queries` for
  checks that need non-zero pseudo-queries. (How different two outputs are is
  :mod:`attnres_fx.checks`, which the CLI's verdicts use too.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnres_fx.api import sites
from attnres_fx.compat import unwrapped
from attnres_fx.models import HF_MODELS, LAYERS, hf_model, main_output


@dataclass(frozen=True)
class Expected:
    """What AttnRes should find in one tiny architecture."""

    parallel_residual: bool         # h + attn(ln1(h)) + mlp(ln2(h)): one site per layer
    streams: dict[str, int]         # stream -> residual sites (the final aggregation not counted)
    layer_paths: dict[str, str]     # stream -> the ModuleList holding its layers
    norm: str                       # "layernorm" | "rmsnorm"
    norm_position: str              # "pre" | "sandwich" (pre and post norms, Gemma2) | "post" (BERT)
    # stream -> owner paths (``{i}`` = layer index) of the modules whose forward performs the residual
    # adds, in execution order within a layer; default ``"<layer path>.{i}"`` for every site.
    site_owners: dict[str, tuple[str, ...]] | None = None
    num_layers: int = LAYERS

    @property
    def num_streams(self) -> int:
        return len(self.streams)

    @property
    def num_sites(self) -> int:
        return sum(self.streams.values())

    @property
    def sites_per_layer(self) -> dict[str, int]:
        return {k: v // self.num_layers for k, v in self.streams.items()}

    def owner_paths(self, stream: str | None = None) -> list[str]:
        """Module paths owning each residual add of ``stream`` (all streams when None), in execution
        order: ``["model.layers.0", "model.layers.0", "model.layers.1", ...]`` for a pre-norm LM (its two
        sites share the layer's path), one entry per layer for parallel layers (Phi, GPT-NeoX)."""
        out = []
        for st in [stream] if stream else list(self.streams):
            patterns = (self.site_owners or {}).get(st) or (self.layer_paths[st] + ".{i}",) * self.sites_per_layer[st]
            for i in range(self.num_layers):
                out.extend(p.format(i=i) for p in patterns)
        return out


_SEQUENTIAL = {"main": 2 * LAYERS}          # attention and MLP sites in every layer
_T5_OWNERS = {"encoder": ("encoder.block.{i}.layer.0", "encoder.block.{i}.layer.1"),
              "decoder": ("decoder.block.{i}.layer.0", "decoder.block.{i}.layer.1", "decoder.block.{i}.layer.2")}
_LLAMA_LIKE = Expected(False, _SEQUENTIAL, {"main": "model.layers"}, "rmsnorm", "pre")

EXPECTED: dict[str, Expected] = {
    "gpt2": Expected(False, _SEQUENTIAL, {"main": "transformer.h"}, "layernorm", "pre"),
    "llama": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "gemma2": Expected(False, _SEQUENTIAL, {"main": "model.layers"}, "rmsnorm", "sandwich"),
    "phi": Expected(True, {"main": LAYERS}, {"main": "model.layers"}, "layernorm", "pre"),
    "gpt_neox": Expected(True, {"main": LAYERS}, {"main": "gpt_neox.layers"}, "layernorm", "pre"),
    "t5_encoder": Expected(False, {"encoder": 2 * LAYERS}, {"encoder": "encoder.block"}, "rmsnorm", "pre",
                           site_owners={"encoder": _T5_OWNERS["encoder"]}),
    "t5": Expected(False, {"encoder": 2 * LAYERS, "decoder": 3 * LAYERS},
                   {"encoder": "encoder.block", "decoder": "decoder.block"}, "rmsnorm", "pre", site_owners=_T5_OWNERS),
    "vit": Expected(False, _SEQUENTIAL, {"main": "layers"}, "layernorm", "pre"),
    "vit_classifier": Expected(False, _SEQUENTIAL, {"main": "vit.layers"}, "layernorm", "pre"),
    "bert": Expected(False, _SEQUENTIAL, {"main": "encoder.layer"}, "layernorm", "post",
                     site_owners={"main": ("encoder.layer.{i}.attention.output", "encoder.layer.{i}.output")}),
}
PRE_NORM_NAMES = tuple(name for name in HF_MODELS if EXPECTED[name].norm_position != "post")


def randomise_pseudo_queries(model: nn.Module, seed: int = 1, std: float = 1.0) -> nn.Module:
    """Random pseudo-queries and key-norm weights in every ``BlockAttnRes`` of ``model``: the AttnRes
    model then differs from the plain residual one, which checks against an oracle need."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for site in sites(model):
            module = unwrapped(model).get_submodule(site.name)
            module.proj.weight.copy_(torch.randn(module.proj.weight.shape, generator=generator) * std)
            module.norm.weight.uniform_(0.5, 1.5, generator=generator)
    return model


def lm_loss(name: str, output, inputs: tuple[tuple, dict]) -> torch.Tensor:
    """A scalar training loss: next-token cross-entropy for language models (T5: on the decoder ids),
    cross-entropy against fixed labels for classifiers, and for encoders the squared error to a fixed
    random target (``mean(h**2)`` would not do: encoders end in a norm, so it is ~1 whatever h is)."""
    spec = hf_model(name)
    y = main_output(name, output)
    args, kwargs = inputs
    cross_entropy = torch.nn.functional.cross_entropy
    if spec.is_lm:
        ids = kwargs["decoder_input_ids"] if spec.task == "seq2seq_lm" else (args[0] if args else kwargs["input_ids"])
        return cross_entropy(y[:, :-1].reshape(-1, y.shape[-1]).float(), ids[:, 1:].reshape(-1))
    if spec.task == "image_classifier":
        return cross_entropy(y.float(), torch.arange(y.shape[0], device=y.device) % y.shape[-1])
    generator = torch.Generator().manual_seed(99 + y.numel())
    target = torch.randn(tuple(y.shape), generator=generator).to(y.device)
    return (y.float() - target).pow(2).mean()
