"""Memory-traffic model of the residual stream: reads and writes per layer, in units of d.

One unit is one token's hidden vector (d elements) read or written once; "layer" is one residual site
(one sublayer), which is what the paper's L counts (L = N * S). Costs are per token, so they hold for
any batch; ``bytes_per_forward`` scales them by tokens, d and the element size.

Accounting (per layer l = 1..L, block n = ceil(l / S), i = l - (n - 1) * S its position in the block;
the layer's sublayer output f_l is written by the sublayer itself and charged to nobody, as in the
paper's standard-residual row):

- ``standard``: ``h_{l+1} = h_l + f_l``: read h_l and f_l, write h_{l+1}.  R = 2, W = 1.
- ``block_per_site``: the partial-sum update (read partial and f, write partial; the same 2 + 1 as the
  standard add) fused with the site's aggregation, which reads the n completed blocks b_0..b_{n-1}
  (the partial is already in registers) and writes h.  R = 2 + n, W = 2.
- ``block_cached_keys``: as per site, but each completed block's key scale rsqrt(mean(b^2)) is computed
  once per block and then read as one scalar per block per site (n / d), written once (1 / (S d)).
  The dot product with the site's own query still has to read every block, so caching the key saves
  one reduction per block per site (FLOPs), not traffic: this row equals the per-site one up to the
  scalar terms, which are only counted when ``dim`` is given.
- ``block_two_phase``: phase 1 reads the n completed blocks once for the block's S queries (n / S per
  layer); phase 2 is fused with the partial-sum update (R 2, W 1), reads its query's phase-1 result and
  writes h.  R = 3 + n / S, W = 2.
- ``full_per_site``: Full AttnRes (every sublayer output is a source): layer l reads its l sources
  v_0..v_{l-1} and writes h.  R = l, W = 1.
- ``full_two_phase``: Full AttnRes scheduled in groups of S layers: phase 1 reads the (n - 1) S + 1
  sources before the group once for its S queries; phase 2 reads the i - 1 outputs of the group before
  layer l and its query's phase-1 result, and writes h.  R = ((n - 1) S + 1) / S + i, W = 1.

Phase 1's per-query results (an fp32 vector plus max and sum of exponentials) are written once per
query and read once in phase 2. The paper's figures come out when only the read is charged, so that
is the default; ``strict=True`` charges the write too (+1 per layer for the two-phase rows).

The paper's Table 1 quotes the most expensive layer, the last one (n = N, i = S); this model reports it
(``reads`` / ``writes``) together with the mean over all L layers. For L = 128, N = 8, S = 16 it gives
standard 3d, Block two-phase 3.5 + 2 = 5.5d and Full two-phase (7 + 1/16) + 16 + 1 = 24.06d, the
paper's 3d, 5.5d and 24d (:func:`check_against_paper`). mHC (34d with m = 4 streams) is quoted in
docs/method.md without its terms, so it is not modelled.

``passes`` is how many times an aggregation reads each of its sources: 1 for the fused kernels the
paper assumes; 2 for a kernel that computes the logits in one loop and the weighted sum in another
(what Inductor generates on CPU; the second read may then hit cache). Each extra pass adds one read of
every source an aggregation reads (in-register partial sums included).

    python -m attnres_fx.traffic --layers 128 --blocks 8
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

VARIANTS = {
    "standard": "standard residual",
    "block_per_site": "Block AttnRes, per site",
    "block_cached_keys": "Block AttnRes, cached keys",
    "block_two_phase": "Block AttnRes, two-phase",
    "full_per_site": "Full AttnRes, per site",
    "full_two_phase": "Full AttnRes, two-phase",
}

PAPER_TABLE1 = {"standard": 3.0, "block_two_phase": 5.5, "full_two_phase": 24.0}
PAPER_CONFIG = {"num_layers": 128, "num_blocks": 8}
MHC_PAPER_TOTAL = 34.0   # m = 4 streams; quoted, not modelled


@dataclass(frozen=True)
class Traffic:
    """Reads and writes per layer of one variant, in units of d (one token's hidden vector)."""

    variant: str
    label: str
    reads: float          # the most expensive layer (the paper's figure)
    writes: float
    mean_reads: float     # averaged over all layers
    mean_writes: float
    num_layers: int

    @property
    def total(self) -> float:
        return self.reads + self.writes

    @property
    def mean_total(self) -> float:
        return self.mean_reads + self.mean_writes

    def bytes_per_forward(self, tokens: int, dim: int, bytes_per_element: int = 4) -> float:
        """Residual-stream bytes moved by one forward pass over ``tokens`` tokens."""
        return self.mean_total * self.num_layers * tokens * dim * bytes_per_element


def traffic(num_layers: int, *, num_blocks: int | None = None, block_size: int | None = None,
            dim: int | None = None, passes: int = 1, strict: bool = False) -> list[Traffic]:
    """Per-layer traffic of every variant for ``num_layers`` residual sites.

    Give ``block_size`` (S, sites per block) or ``num_blocks`` (N; S = ceil(L / N)). ``dim`` adds the
    per-token scalar terms (1 / d each: cached key scales, phase-1 max and sum of exponentials).
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    if block_size is None:
        if num_blocks is None or num_blocks < 1:
            raise ValueError("give block_size or num_blocks (>= 1)")
        block_size = math.ceil(num_layers / num_blocks)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    scalar = 0.0 if dim is None else 1.0 / dim
    costs = _layer_costs(block_size, passes, 1.0 if strict else 0.0, scalar)
    rows = []
    for variant, label in VARIANTS.items():
        per_layer = [costs[variant](layer) for layer in range(1, num_layers + 1)]
        reads, writes = per_layer[-1]
        rows.append(Traffic(variant, label, reads, writes, sum(r for r, _ in per_layer) / num_layers,
                            sum(w for _, w in per_layer) / num_layers, num_layers))
    return rows


def _layer_costs(size: int, passes: int, phase1_write: float,
                 scalar: float) -> dict[str, Callable[[int], tuple[float, float]]]:
    extra = passes - 1      # re-reads of the sources by a second loop over them

    def position(layer: int) -> tuple[int, int]:
        block = math.ceil(layer / size)
        return block, layer - (block - 1) * size

    def block_per_site(layer):
        completed, _ = position(layer)
        return 2 + passes * completed + extra, 2.0

    def block_cached_keys(layer):
        completed, _ = position(layer)
        reads, writes = block_per_site(layer)
        return reads + completed * scalar, writes + scalar / size

    def block_two_phase(layer):
        completed, _ = position(layer)
        phase1 = passes * completed / size
        return 3 + extra + phase1 + 2 * scalar, 2 + phase1_write * (1 + 2 * scalar)

    def full_two_phase(layer):
        group, i = position(layer)
        phase1 = passes * ((group - 1) * size + 1) / size
        return phase1 + passes * (i - 1) + 1 + 2 * scalar, 1 + phase1_write * (1 + 2 * scalar)

    return {
        "standard": lambda layer: (2.0, 1.0),
        "block_per_site": block_per_site,
        "block_cached_keys": block_cached_keys,
        "block_two_phase": block_two_phase,
        "full_per_site": lambda layer: (float(passes * layer), 1.0),
        "full_two_phase": full_two_phase,
    }


def check_against_paper() -> dict[str, float]:
    """The model's most-expensive-layer totals for the paper's Table 1 setting (L = 128, N = 8, S = 16).

    Raises ``AssertionError`` if any differs from the paper's figure by more than the paper's rounding
    (its figures have at most one decimal; Full's 24.06 is quoted as 24).
    """
    totals = {row.variant: row.total for row in traffic(**PAPER_CONFIG)}
    for variant, paper in PAPER_TABLE1.items():
        assert abs(totals[variant] - paper) < 0.1, f"{variant}: model {totals[variant]:.3f}d, paper {paper}d"
    return {variant: totals[variant] for variant in PAPER_TABLE1}


def format_table(rows: list[Traffic], *, tokens: int | None = None, dim: int | None = None,
                 bytes_per_element: int = 4) -> str:
    """A markdown table of ``rows`` (from :func:`traffic`); with ``tokens`` and ``dim``, MB per forward."""
    header = ["variant", "reads (last layer)", "writes", "total", "mean total", "vs standard"]
    with_bytes = tokens is not None and dim is not None
    if with_bytes:
        header.append(f"MB per forward ({tokens} tokens, d={dim})")
    base = next((row.mean_total for row in rows if row.variant == "standard"), None)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row.label, f"{row.reads:.2f}d", f"{row.writes:.2f}d", f"{row.total:.2f}d",
                 f"{row.mean_total:.2f}d", f"{row.mean_total / base:.2f}x" if base else "-"]
        if with_bytes:
            cells.append(f"{row.bytes_per_forward(tokens, dim, bytes_per_element) / 1e6:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m attnres_fx.traffic", description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=PAPER_CONFIG["num_layers"], help="residual sites L")
    parser.add_argument("--blocks", type=int, default=PAPER_CONFIG["num_blocks"], help="blocks N")
    parser.add_argument("--block-size", type=int, default=None, help="sites per block S (wins over --blocks)")
    parser.add_argument("--dim", type=int, default=None, help="hidden size d (adds 1/d scalar terms)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per forward, for MB (needs --dim)")
    parser.add_argument("--passes", type=int, default=1, help="reads of each source per aggregation")
    parser.add_argument("--strict", action="store_true", help="charge phase 1's result writes")
    args = parser.parse_args(argv)
    rows = traffic(args.layers, num_blocks=args.blocks, block_size=args.block_size, dim=args.dim,
                   passes=args.passes, strict=args.strict)
    print(format_table(rows, tokens=args.tokens, dim=args.dim))


if __name__ == "__main__":
    main()
