"""The torch.fx passes, one step of the pipeline each: detect -> plan -> rewrite -> schedule.

Detection is split by job: :mod:`.dataflow` (what a value depends on, reachability), :mod:`.node_kinds`
(op tables and what a node is, stream ops among them), :mod:`.branch_kinds` (what a sublayer does),
:mod:`.norms` (whether a branch reads the stream through a norm), :mod:`.provenance` (the module a node
comes from: the one reader of ``nn_module_stack`` and Dynamo's source strings), :mod:`.matching` (whether
an add is a site; failures as falsy records), :mod:`.streams` (the frozen records), :mod:`.detect`
(sites into streams). :mod:`.pipeline` runs the rewrite for every route.

Each step follows ``torch.fx.passes.infra``: analyses (:func:`detect_residual_streams`,
:func:`make_plan`) return immutable data; transformations are ``PassBase`` subclasses with ``requires``
/ ``ensures`` checks that return a ``PassResult`` saying whether the graph was modified, and a
``preserves_computation`` flag that the tests hold them to.
"""

from .detect import detect_residual_streams
from .streams import Branch, Detection, RejectedAdd, ResidualSite, ResidualStream
from .plan import Plan, Site, StreamPlan, make_plan, match_streams
from .rewrite import BlockAttnResRewrite, ModuleCalls, ParameterInputs, Replacement, new_modules
from .two_phase import TwoPhaseSchedule, apply_two_phase, can_apply_two_phase

__all__ = [
    "BlockAttnResRewrite", "Branch", "Detection", "ModuleCalls", "ParameterInputs", "Plan", "RejectedAdd",
    "Replacement", "ResidualSite", "ResidualStream", "Site", "StreamPlan", "TwoPhaseSchedule",
    "apply_two_phase", "can_apply_two_phase", "detect_residual_streams", "make_plan", "match_streams",
    "new_modules",
]
