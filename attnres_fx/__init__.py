"""attnres_fx: rewrite the residual stream of an existing Transformer into Block Attention Residuals.

    import attnres_fx
    new = attnres_fx.attnresify(model)                      # or attnresify(model, (x,), num_blocks=8)
    for site in attnres_fx.sites(new):
        print(site)
"""

from . import reference
from .api import Site, attnresify, detect, sites
from .block_attnres import BlockAttnRes
from .errors import (
    AttnResError,
    AttnResWarning,
    ExportError,
    NoResidualStreamError,
    TraceError,
    UnsupportedArchitectureError,
)

__version__ = "0.1.0"

__all__ = [
    "AttnResError", "AttnResWarning", "BlockAttnRes", "ExportError", "NoResidualStreamError", "Site",
    "TraceError", "UnsupportedArchitectureError", "attnresify", "detect", "reference", "sites",
]
