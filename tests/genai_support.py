"""Whether onnxruntime-genai is installed (the ``genai`` extra; ``make venv`` installs it)."""

import importlib.util

import pytest

needs_genai = pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None,
                                 reason="needs onnxruntime-genai (pip install 'attnres-fx[genai]')")
