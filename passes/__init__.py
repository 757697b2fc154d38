"""torch.fx passes: residual-stream detection, the Block AttnRes rewrite, the two-phase schedule.

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
from .two_phase import TwoPhaseSchedule, apply_two_phase, can_apply_two_phase

__all__ = [
    "BlockAttnResRewrite", "Branch", "DetectResidualStreams", "RejectedAdd", "ResidualSite",
    "ResidualStream", "ResidualStreams", "RewrittenSite", "TwoPhaseSchedule", "apply_two_phase", "block_sizes",
    "can_apply_two_phase", "detect_residual_streams",
]
