"""The records detection returns: streams, their sites, each site's branches, and the adds rejected, all
frozen (a dry run prints them; the plan and the rewrite read them)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from attnres_fx.text import format_table

from . import provenance


@dataclass(frozen=True, eq=False)
class Branch:
    """One sublayer ``f(norm(h))`` of a site: its output(s) and the nodes between ``h`` and them.

    ``outputs`` has one node, or several for channel-mixing summands added to the stream one by one
    (``h + routed(u) + shared(u)``): the sublayer's output is their sum."""

    outputs: tuple[fx.Node, ...]
    region: frozenset[fx.Node]
    kind: str                       # "attn" | "mixer" (other token mixing) | "mlp" | "branch" (neither told)
    module_path: str
    normalised: bool                # reads the stream only through a norm


@dataclass(frozen=True, eq=False)
class ResidualSite:
    """An add (or a tree of adds, for parallel layers) that puts branch outputs onto the stream."""

    add: fx.Node                    # the add whose output is the stream after this site
    adds: tuple[fx.Node, ...]       # every add node of the site (more than one for parallel layers)
    stream_in: fx.Node              # the stream value h as this site reads it
    inbound: tuple[fx.Node, ...]    # stream ops from the previous stream value to stream_in, in order
    branches: tuple[Branch, ...]
    owner: str                      # dotted path of the module whose forward performs the add
    # The leading dimensions of ``stream_in`` (and of the site's output): two stream values of one
    # layout have the same shape. Values of different layouts hold the same number of elements.
    layout: str

    @property
    def normalised(self) -> bool:
        return all(b.normalised for b in self.branches)

    @property
    def kind(self) -> str:
        return "+".join(b.kind for b in self.branches)


@dataclass(frozen=True, eq=False)
class ResidualStream:
    """A chain of sites: ``start`` is ``b_0`` (e.g. the embedding), ``sites`` in execution order."""

    start: fx.Node
    sites: tuple[ResidualSite, ...]
    dim: int | None                 # hidden size, None where the graph does not tell
    layout: str                     # the layout of ``start`` (see ResidualSite.layout)

    @property
    def end(self) -> fx.Node:
        return self.sites[-1].add

    @property
    def layers_path(self) -> str:
        """The container of the stream's layers: ``blocks``, ``model.layers``, ``encoder.block``."""
        common = provenance.common_parts(s.owner for s in self.sites)
        while common and common[-1].isdigit():
            common.pop()
        return ".".join(common)

    @property
    def owner(self) -> str:
        """The module holding the stream: the one above its layer list (``''``, ``model``, ``encoder``)."""
        layers = self.layers_path
        numbered = bool(layers) and any(
            s.owner.startswith(layers + ".") and s.owner[len(layers) + 1:].split(".")[0].isdigit()
            for s in self.sites)
        if not numbered:
            return layers
        return layers.rsplit(".", 1)[0] if "." in layers else ""


@dataclass(frozen=True)
class RejectedAdd:
    node: str
    owner: str
    reason: str

    def __str__(self) -> str:
        where = f" in {self.owner}" if self.owner else ""
        return f"{self.node}{where}: {self.reason}"


@dataclass(frozen=True)
class Detection:
    """What detection found: the streams, every add it rejected (and why), the post-norm links, and the
    rejected adds that continue a stream and the ops that link one stream to the next
    (``unconverted``: converting the streams leaves them as they are, so the conversion would be
    partial)."""

    streams: tuple[ResidualStream, ...]
    rejected: tuple[RejectedAdd, ...]
    post_norm: tuple[str, ...]
    unconverted: tuple[RejectedAdd, ...]

    @property
    def num_sites(self) -> int:
        return sum(len(s.sites) for s in self.streams)

    def table(self) -> str:
        rows = [(str(s_idx), str(j), site.owner or "<root>", site.kind, "yes" if site.normalised else "NO (raw)")
                for s_idx, stream in enumerate(self.streams) for j, site in enumerate(stream.sites)]
        return format_table(("stream", "site", "layer", "kind", "normalised"), rows)

    def __str__(self) -> str:
        owners = ", ".join(f"stream {i} in {s.owner or '<root>'}" for i, s in enumerate(self.streams))
        text = f"{self.num_sites} residual sites in {len(self.streams)} stream(s) ({owners})\n{self.table()}"
        if self.unconverted:
            text += "\nadds and ops on a stream that are no residual site (left as they are):\n" + "\n".join(
                f"  - {add}" for add in self.unconverted)
        return text
