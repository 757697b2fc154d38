"""The torch.fx passes, one step of the pipeline each: detect -> plan -> rewrite -> schedule.

Each step follows ``torch.fx.passes.infra``: analyses (:func:`detect_residual_streams`,
:func:`make_plan`) return immutable data; transformations are ``PassBase`` subclasses with ``requires``
/ ``ensures`` checks that return a ``PassResult`` saying whether the graph was modified, and a
``preserves_computation`` flag that the tests hold them to.
"""

from .detect import Branch, Detection, RejectedAdd, ResidualSite, ResidualStream, detect_residual_streams
from .plan import Plan, Site, StreamPlan, make_plan, match_streams
from .rewrite import BlockAttnResRewrite, ModuleCalls, ParameterInputs, Replacement, new_modules
from .two_phase import TwoPhaseSchedule, apply_two_phase, can_apply_two_phase

__all__ = [
    "BlockAttnResRewrite", "Branch", "Detection", "ModuleCalls", "ParameterInputs", "Plan", "RejectedAdd",
    "Replacement", "ResidualSite", "ResidualStream", "Site", "StreamPlan", "TwoPhaseSchedule",
    "apply_two_phase", "can_apply_two_phase", "detect_residual_streams", "make_plan", "match_streams",
    "new_modules",
]
