"""The tiny Hugging Face models of :mod:`attnres_fx.models` with what the tests expect of them.

``transformers`` is imported lazily: tests skip when :func:`transformers_available` is False.
"""

from __future__ import annotations

import pytest

from attnres_fx.checks import eps_bound, relative_error  # noqa: F401 - re-exported for the tests
from attnres_fx.models import (HF_NAMES, build_hf, hf_example_inputs, hf_model,  # noqa: F401
                               main_output, transformers_available)
from attnres_fx.testing import EXPECTED, PRE_NORM_NAMES, lm_loss  # noqa: F401

needs_hf = pytest.mark.skipif(not transformers_available(),
                              reason="needs Hugging Face transformers (pip install 'attnres-fx[hf]')")
LM_NAMES = tuple(name for name in PRE_NORM_NAMES if hf_model(name).is_lm)
DECODER_LM_NAMES = tuple(name for name in LM_NAMES if hf_model(name).task == "causal_lm")
