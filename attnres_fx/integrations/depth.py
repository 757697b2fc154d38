"""Depth-attention maps: how much each site's softmax over depth weighs each of its sources.

Every ``BlockAttnRes`` of a converted model attends over the sources ``b_0`` (the embedding), the
completed blocks ``b_1 .. b_{n-1}`` and the current partial sum. Source ``j`` of any site is block ``j``
of its stream: a site at the start of block ``k`` reads ``b_0 .. b_{k-1}`` (the last one is the partial
sum the block boundary is about to commit), a site inside block ``k`` reads ``b_0 .. b_{k-1}`` and the
partial sum of block ``k``. A map is therefore a lower-triangular table, rows = consuming sites in
execution order, columns = source blocks, the layout of the method paper's depth-attention figure::

    weights = attnres_fx.depth_weights(model, ids)      # one no-grad call of the model
    print(weights)                                      # a table: site, kind, block, weight per source
    matrix = weights.to_numpy()                         # [sites, blocks + 1], NaN where no source
    weights.plot("depth.png")                           # heatmap (needs matplotlib: attnres-fx[viz])

The weights are recorded by forward pre-hooks on the ``BlockAttnRes`` modules, from the sources each
module receives and its own parameters; the hooks only read, so the model computes what it computes
without them. :class:`DepthRecorder` is the same recording around calls the caller makes (a training
step): :mod:`attnres_fx.integrations.training` builds its monitor on it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..compat import unwrapped
from ..conversion import sites as sites_of
from ..op.aggregation import depth_logit, folded_query
from ..op.module import BlockAttnRes
from ..errors import DepthWeightsError
from ..conversion import conversion_of
from ..routing import eager_route
from ..passes.plan import Site
from ..text import format_table

# Cells above this count are too small to carry their value as text in a heatmap.
ANNOTATE_MAX_CELLS = 400


def source_label(index: int) -> str:
    """``"emb"`` for source 0 (the embedding ``b_0``), ``"b3"`` for block 3."""
    return "emb" if index == 0 else f"b{index}"


@dataclass(frozen=True)
class SiteWeights:
    """The depth attention of one site over the tokens of the recorded calls.

    ``weights``: the softmax weight of each source, averaged over tokens (``[num_sources]``, sums to 1).
    ``entropy``: the per-token entropy of the weights in nats, averaged over tokens (0 for a site that
    puts all weight on one source, ``log(num_sources)`` for uniform weights). ``max_weight``: the
    largest weight each token gives one source, averaged over tokens (1 when every token attends to a
    single source, even if not the same one; ``1 / num_sources`` for uniform weights). ``tokens``: how
    many token positions were averaged (every position of the sources, padding included). ``per_token``: the
    weights of every token, ``[*token_dims, num_sources]`` (``[batch, seq, n]`` for a language model),
    when recorded with ``per_token=True``.
    """

    site: Site
    weights: np.ndarray
    entropy: float
    max_weight: float
    tokens: int
    per_token: torch.Tensor | None = None

    @property
    def top_source(self) -> int:
        """The source with the largest token-averaged weight (its block index)."""
        return int(self.weights.argmax())


class DepthWeights:
    """Per-site depth-attention weights of a converted model; see the module docstring.

    Iterating gives one :class:`SiteWeights` per site in execution order; ``weights["layers.3.mlp_res"]``
    looks one up by site name.
    """

    def __init__(self, rows: list[SiteWeights], model_name: str, block_sizes: tuple[int, ...] = ()):
        self.rows = tuple(rows)
        self.model_name = model_name
        self.block_sizes = tuple(block_sizes)
        self._by_name = {row.site.name: row for row in self.rows}

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, name: str) -> SiteWeights:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no site named {name!r}; sites: {list(self._by_name)}") from None

    def to_numpy(self) -> np.ndarray:
        """``[num_sites, num_columns]``: row ``i`` is site ``i``'s token-averaged weights, column ``j`` its
        source block ``j``; ``NaN`` where the site has no such source (the upper triangle). Columns run
        to the widest site of any stream; rows of every stream follow each other in execution order."""
        return _matrix(self.rows)

    def collapsed(self, threshold: float) -> list[SiteWeights]:
        """Sites with more than one source whose tokens put, on average, at least ``threshold`` of their
        weight on one source (a single-source site has weight 1 by construction)."""
        return [row for row in self.rows if row.site.num_sources > 1 and row.max_weight >= threshold]

    def __str__(self) -> str:
        width = max(len(row.weights) for row in self.rows)
        header = ("site", "kind", "block", *(source_label(j) for j in range(width)), "entropy", "max/token")
        table = [(row.site.name, row.site.kind, "-" if row.site.block is None else str(row.site.block),
                  *(f"{w:.3f}" for w in row.weights), *([""] * (width - len(row.weights))),
                  f"{row.entropy:.3f}", f"{row.max_weight:.3f}")
                 for row in self.rows]
        return (f"Depth attention of {self.description} (source weights averaged over tokens)\n"
                f"{format_table(header, table)}")

    @property
    def description(self) -> str:
        """The model's name and its conversion: ``"TinyTransformer, block size 6"``."""
        if not self.block_sizes:
            return self.model_name
        if set(self.block_sizes) == {1}:
            return f"{self.model_name}, Full AttnRes"
        sizes = ", ".join(map(str, dict.fromkeys(self.block_sizes)))
        return f"{self.model_name}, block size {sizes}"

    def plot(self, path: str | Path, *, size: tuple[float, float] | None = None, dpi: int = 100,
             title: str | None = None) -> Path:
        """Write a heatmap PNG of the token-averaged weights to ``path`` and return the path.

        One panel per residual stream: rows are the consuming sites (labelled with their names), columns
        the source blocks (``emb``, ``b1``, ...), cells coloured on a fixed 0..1 scale with a colour bar,
        empty above the diagonal; values are written in the cells when they fit. ``size`` is the figure
        size in inches (default: grows with the number of sites and blocks) and the PNG is exactly
        ``size * dpi`` pixels. Needs matplotlib (``pip install 'attnres-fx[viz]'``).
        """
        plt_figure, canvas_class = _matplotlib()
        streams = sorted({row.site.stream for row in self.rows})
        panels = [[row for row in self.rows if row.site.stream == stream] for stream in streams]
        widest = max(len(row.weights) for row in self.rows)
        tallest = max(len(panel) for panel in panels)
        if size is None:
            size = (2.5 + len(panels) * (1.5 + 0.45 * widest), 1.8 + 0.25 * tallest)
        figure = plt_figure(figsize=size, dpi=dpi, layout="constrained")
        canvas_class(figure)
        axes = figure.subplots(1, len(panels), squeeze=False)[0]
        image = None
        for ax, stream, panel in zip(axes, streams, panels):
            matrix = _matrix(panel)
            image = ax.imshow(np.ma.masked_invalid(matrix), vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto",
                              interpolation="nearest")
            ax.set_xticks(range(matrix.shape[1]), [source_label(j) for j in range(matrix.shape[1])])
            ax.set_yticks(range(len(panel)), [row.site.name for row in panel])
            ax.tick_params(axis="x", labelrotation=90 if matrix.shape[1] > 12 else 0)
            ax.set_xlabel("source block")
            ax.set_ylabel("consuming site")
            if len(panels) > 1:
                ax.set_title(f"stream {stream}", fontsize="medium")
            if matrix.size <= ANNOTATE_MAX_CELLS:
                for (i, j), value in np.ndenumerate(matrix):
                    if not math.isnan(value):
                        ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize="x-small",
                                color="black" if value > 0.6 else "white")
        # A colour bar as tall as a long list of sites would dwarf its labels.
        figure.colorbar(image, ax=list(axes), label="softmax weight (token average)", shrink=min(1.0, 6.0 / size[1]))
        figure.suptitle(title or f"Depth attention: {self.description}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, format="png", dpi=dpi)
        return path


class DepthRecorder:
    """Records the depth attention of every site while the model runs; :func:`depth_weights` is one
    recorded no-grad call.

    ``with DepthRecorder(model) as recorder: model(...)`` then ``recorder.result()``. Several calls in
    the block accumulate (the averages cover all their tokens). The recording is done under
    ``torch.no_grad`` on detached sources: it adds nothing to the autograd graph of the calls. A model
    routed through Inductor (:func:`attnres_fx.compile`) runs its calls within the block on the eager
    route, where the ``BlockAttnRes`` modules are called as modules; its compiled graphs are kept and
    serve again after the block.
    """

    def __init__(self, model: nn.Module, *, per_token: bool = False):
        self.per_token = per_token
        self.sites = sites_of(model)
        if not self.sites:
            raise ValueError(f"model: depth weights need a model converted by attnres_fx.attnresify (or its "
                             f"attnres_fx.rewrite graph); {type(model).__name__} has no AttnRes sites")
        self._root = unwrapped(model)
        self._sums: dict[str, torch.Tensor] = {}
        self._entropy: dict[str, float] = {}
        self._max: dict[str, float] = {}
        self._tokens: dict[str, int] = {}
        self._per_token: dict[str, list[torch.Tensor]] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> DepthRecorder:
        if conversion_of(self._root) is not None:
            self._stack.enter_context(eager_route(self._root))
        try:
            for site in self.sites:
                module = self._root.get_submodule(site.name)
                handle = module.register_forward_pre_hook(self._hook(site))
                self._stack.callback(handle.remove)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()

    def _hook(self, site: Site):
        def record(module: BlockAttnRes, sources: tuple[torch.Tensor, ...]) -> None:
            with torch.no_grad():
                weights = source_weights(module, sources)
            flat = weights.reshape(-1, weights.shape[-1]).double()
            entropy = -(flat * flat.clamp_min(torch.finfo(torch.float64).tiny).log()).sum(-1)
            total = flat.sum(0)
            self._sums[site.name] = self._sums[site.name] + total if site.name in self._sums else total
            self._entropy[site.name] = self._entropy.get(site.name, 0.0) + float(entropy.sum())
            self._max[site.name] = self._max.get(site.name, 0.0) + float(flat.max(-1).values.sum())
            self._tokens[site.name] = self._tokens.get(site.name, 0) + flat.shape[0]
            if self.per_token:
                self._per_token.setdefault(site.name, []).append(weights)
        return record

    def result(self) -> DepthWeights:
        """The weights recorded so far; :class:`~attnres_fx.DepthWeightsError` if a site did not run."""
        missing = [site.name for site in self.sites if site.name not in self._tokens]
        if missing:
            raise DepthWeightsError(f"depth weights: the sites {missing} did not run as modules during the "
                               "recorded calls (a call that does not reach them, or a graph that inlines "
                               "the aggregation instead of calling the BlockAttnRes modules)")
        rows = []
        for site in self.sites:
            tokens = self._tokens[site.name]
            per_token = None
            if self.per_token:
                calls = self._per_token[site.name]
                per_token = calls[0] if len(calls) == 1 else _concatenate(calls, site)
            rows.append(SiteWeights(site, (self._sums[site.name] / tokens).cpu().numpy(),
                                    self._entropy[site.name] / tokens, self._max[site.name] / tokens, tokens,
                                    per_token))
        return DepthWeights(rows, model_name(self._root), _block_sizes(self._root))


def source_weights(module: BlockAttnRes, sources: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The softmax weights ``module`` gives ``sources`` per token, fp32 ``[..., num_sources]``: the
    logits ``(w * g) . (v / rms(v))`` of :func:`~attnres_fx.op.module.aggregate`, softmax over
    sources."""
    query = folded_query(module.proj.weight.detach(), module.norm.weight.detach())
    logits = [depth_logit(source.detach().float(), query, module.eps) for source in sources]
    return torch.cat(logits, dim=-1).softmax(dim=-1)


def depth_weights(model: nn.Module, *inputs: Any, per_token: bool = False, **kwargs: Any) -> DepthWeights:
    """Call ``model(*inputs, **kwargs)`` once, without gradients, and return every site's depth
    attention (:class:`DepthWeights`).

    ``model`` is a converted model (eager or routed through Inductor: the call then takes the eager
    route, and the compiled graphs serve again afterwards) or an :func:`attnres_fx.rewrite` graph. The
    model is left as it was: parameters, mode (train/eval as set: dropout in train mode changes the
    sources, so call ``model.eval()`` first for a deterministic map) and outputs. ``per_token=True``
    also keeps the weights of every token (``SiteWeights.per_token``).

    Example::

        >>> weights = attnres_fx.depth_weights(model, ids)
        >>> weights["blocks.3.mlp_res"].weights         # array([0.12, 0.31, 0.57]): emb, b1, partial b2
        >>> weights.plot("depth.png")
    """
    with DepthRecorder(model, per_token=per_token) as recorder, torch.no_grad():
        model(*inputs, **kwargs)
    return recorder.result()


def model_name(model: nn.Module) -> str:
    """The class name, and a Hugging Face model's checkpoint name when it has one."""
    checkpoint = getattr(getattr(model, "config", None), "name_or_path", "") or ""
    return f"{type(model).__name__} ({checkpoint})" if checkpoint else type(model).__name__


def _matrix(rows: list[SiteWeights] | tuple[SiteWeights, ...]) -> np.ndarray:
    """Token-averaged weights, one row per site, NaN past each site's sources."""
    matrix = np.full((len(rows), max(len(row.weights) for row in rows)), np.nan)
    for i, row in enumerate(rows):
        matrix[i, :len(row.weights)] = row.weights
    return matrix


def _block_sizes(model: nn.Module) -> tuple[int, ...]:
    conversion = conversion_of(model)
    if conversion is not None:
        return conversion.plan.block_sizes
    return tuple(getattr(model, "meta", {}).get("attnres", {}).get("block_sizes", ()))


def _concatenate(calls: list[torch.Tensor], site: Site) -> torch.Tensor:
    """The per-token weights of a site that ran more than once: the calls along the first dimension."""
    try:
        return torch.cat(calls, dim=0)
    except RuntimeError as err:
        shapes = [tuple(call.shape) for call in calls]
        raise DepthWeightsError(f"depth weights: {site.name} ran {len(calls)} times with per-token shapes {shapes} "
                           "that do not concatenate along the first dimension; record the calls one at a "
                           "time") from err


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("DepthWeights.plot needs matplotlib: pip install 'attnres-fx[viz]'") from err
    return Figure, FigureCanvasAgg
