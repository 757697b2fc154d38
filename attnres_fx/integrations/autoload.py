"""Models converted as transformers builds them: the construction hook.

:func:`enable` (``attnres_fx/__init__.py`` calls it once) makes transformers report to attnres_fx every
model it builds, right after the model's ``post_init``, and every ``from_pretrained`` call
(:func:`attnres_fx.compat.hook_pretrained_model`). A model whose config records a saved conversion is
converted from it (:func:`attnres_fx.integrations.hf.convert_saved`), and ``from_pretrained`` reads and
checks the folder's checkpoint once (:func:`attnres_fx.integrations.hf.load_pretrained`). :func:`disable`
takes the hook off: transformers then builds every model as it is written. Neither imports transformers:
the hook goes in once transformers' ``modeling_utils`` is imported (:func:`attnres_fx.compat.after_import`),
its release is checked as transformers itself is imported (:mod:`attnres_fx.integrations.hf`).

Besides a saved conversion, a *construction policy* may ask for conversions (:func:`construction_policy`):
harnesses that run a library's own tests on converted models set one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from torch import nn

from .. import api, compat
from ..conversion import is_converted
from . import hf

_MODELING = "transformers.modeling_utils"

# Besides a config's entry, what else asks for conversion at construction: a function of the model
# returning attnresify's arguments (or None).
_POLICY: list[Callable[[nn.Module], dict | None]] = []


def enable() -> None:
    """Convert the models transformers builds from a config with a saved conversion (now, or once
    transformers is imported)."""
    compat.after_import(_MODELING, _hook)


def disable() -> None:
    """Let transformers build every model as it is written."""
    compat.cancel_after_import(_MODELING, _hook)
    modeling = sys.modules.get(_MODELING)
    if modeling is not None:
        compat.unhook_pretrained_model(modeling.PreTrainedModel)


def _hook(modeling_utils) -> None:
    compat.hook_pretrained_model(modeling_utils.PreTrainedModel, built, hf.load_pretrained)


def built(model: nn.Module) -> None:
    """What transformers' ``post_init`` does for attnres_fx: a saved conversion applied, else the policy's."""
    if hf.convert_saved(model) or not _POLICY:
        return
    options = _POLICY[0](model)
    if options is None or is_converted(model):
        return
    after = options.pop("after", None)
    with hf.eval_mode(model):
        api.attnresify(model, **options)
    if after is not None:
        after(model)


def construction_policy(policy: Callable[[nn.Module], dict | None] | None) -> None:
    """Convert every ``PreTrainedModel`` built from now on for which ``policy(model)`` returns attnresify's
    arguments (after a hook of ``"after"`` in them, a callable run on the converted model); ``None`` stops
    it. The policy decides which models: one built inside another is usually the outer one's part."""
    _POLICY[:] = [policy] if policy is not None else []
