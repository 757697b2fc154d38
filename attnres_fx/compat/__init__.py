"""Where attnres_fx reaches into other libraries' internals, one module per library: :mod:`.torch` and
:mod:`.transformers`. Every difference between the releases attnres_fx supports is handled there, each
entry naming the releases it covers. Importing this package checks the torch version."""

from .torch import *  # noqa: F401, F403
from .torch import __all__ as _torch_names
from .transformers import *  # noqa: F401, F403
from .transformers import __all__ as _transformers_names

__all__ = [*_torch_names, *_transformers_names]
