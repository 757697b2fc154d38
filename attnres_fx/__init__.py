"""attnres_fx: turn the residual stream of an existing Transformer into Block Attention Residuals.

    import attnres_fx
    attnres_fx.attnresify(model)                 # in place: the same model, AttnRes inside
    for site in attnres_fx.sites(model):
        print(site)
    attnres_fx.remove(model)                     # back to the original
"""

from .api import attnresify, compile, conversion_options, detect, is_converted, plan_of, remove, rewrite, sites
from .block_attnres import BlockAttnRes
from .errors import (
    AttnResError,
    AttnResWarning,
    CheckpointMismatchError,
    ExportError,
    NoResidualStreamError,
    PassContractError,
    RoutingError,
    StreamMismatchError,
    TraceError,
    UnsupportedArchitectureError,
)
from .hf import from_pretrained
from .passes.plan import Site

__version__ = "0.2.0"

__all__ = [
    "AttnResError", "AttnResWarning", "BlockAttnRes", "CheckpointMismatchError", "ExportError",
    "NoResidualStreamError", "PassContractError", "RoutingError", "Site", "StreamMismatchError", "TraceError", "UnsupportedArchitectureError",
    "attnresify", "compile", "conversion_options", "detect", "from_pretrained", "is_converted", "plan_of",
    "remove", "rewrite", "sites",
]
