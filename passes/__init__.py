"""torch.fx passes: residual-stream detection and the Block AttnRes rewrite.

Each pass follows ``torch.fx.passes.infra``: a ``PassBase`` with ``requires`` / ``ensures`` checks,
returning a ``PassResult`` that says whether the graph was modified, and a ``preserves_computation``
flag that the tests hold it to.
"""

from .block_attnres import BlockAttnResRewrite, RewrittenSite, block_sizes
from .residual_stream import (
    Branch,
    DetectResidualStreams,
    RejectedAdd,
    ResidualSite,
    ResidualStream,
    ResidualStreams,
    detect_residual_streams,
)

__all__ = [
    "BlockAttnResRewrite", "Branch", "DetectResidualStreams", "RejectedAdd", "ResidualSite",
    "ResidualStream", "ResidualStreams", "RewrittenSite", "block_sizes", "detect_residual_streams",
]
