"""attnres_fx: turn the residual stream of an existing Transformer into Block Attention Residuals.

    import attnres_fx
    attnres_fx.attnresify(model)                 # in place: the same model, AttnRes inside
    for site in attnres_fx.sites(model):
        print(site)
    attnres_fx.remove(model)                     # back to the original

Inspecting and training a converted model::

    print(attnres_fx.depth_weights(model, ids))  # softmax weights over depth, per site
    optimizer = torch.optim.AdamW(attnres_fx.param_groups(model, lr=3e-4, weight_decay=0.1))
"""

from .api import attnresify, compile, detect, remove, rewrite
from .op.module import BlockAttnRes
from .config import AttnResConfig
from .conversion import config_of, conversion_options, is_converted, plan_of, sites
from .integrations.depth import DepthRecorder, DepthWeights, SiteWeights, depth_weights
from .errors import (
    AttnResError,
    AttnResWarning,
    CheckpointMismatchError,
    DepthWeightsError,
    ExportError,
    ForeignCompileError,
    NoResidualStreamError,
    PassContractError,
    RoutingError,
    ServingLayoutError,
    StreamMismatchError,
    TraceError,
    UnsupportedArchitectureError,
    WriteError,
)
from .integrations import autoload
from .integrations.hf import from_pretrained
from .integrations.pipelining import pipeline_stages
from .passes.plan import Site
from .version import __version__ as __version__  # re-exported: `attnres_fx.__version__`
from .integrations.training import (
    depth_metrics,
    depth_monitor_callback,
    freeze,
    monitor_depth,
    param_groups,
    unfreeze,
)


# Models transformers builds from a config with a saved conversion are converted as they are built.
autoload.enable()

__all__ = [
    "AttnResConfig", "AttnResError", "AttnResWarning", "BlockAttnRes", "CheckpointMismatchError", "DepthRecorder",
    "DepthWeights", "DepthWeightsError", "ExportError", "ForeignCompileError", "NoResidualStreamError",
    "PassContractError", "RoutingError", "ServingLayoutError", "Site", "SiteWeights",
    "StreamMismatchError", "TraceError", "UnsupportedArchitectureError", "WriteError", "attnresify", "compile",
    "config_of", "conversion_options", "depth_metrics", "depth_monitor_callback", "depth_weights", "detect", "freeze",
    "from_pretrained", "is_converted", "monitor_depth", "param_groups", "pipeline_stages", "plan_of", "remove",
    "rewrite", "sites",
    "unfreeze",
]
