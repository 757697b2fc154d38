"""attnres_fx.diagnostics: the one reader of failures (root causes, first lines, the user's frame)."""

import os

import pytest

from attnres_fx import diagnostics


def _raise_chain():
    try:
        try:
            raise KeyError("the op's own error")
        except KeyError:
            raise RuntimeError("wrapped") from None      # as Dynamo raises TorchRuntimeError
    except RuntimeError as err:
        raise ValueError("outer") from err


def test_the_chain_looks_through_suppressed_context_to_the_root_cause():
    with pytest.raises(ValueError) as caught:
        _raise_chain()
    assert [type(e) for e in diagnostics.chain(caught.value)] == [ValueError, RuntimeError, KeyError]
    assert isinstance(diagnostics.root_cause(caught.value), KeyError)
    assert diagnostics.describe(caught.value) == "KeyError: \"the op's own error\""


def test_first_line_of_an_empty_message_is_the_repr():
    assert diagnostics.first_line(RuntimeError("")) == "RuntimeError('')"
    assert diagnostics.first_line(RuntimeError("one\ntwo")) == "one"


def test_the_user_frame_is_outside_torch_and_the_machinery():
    with pytest.raises(ValueError) as caught:
        _raise_chain()
    where = diagnostics.user_frame(caught.value)
    assert where.startswith(os.path.abspath(__file__)) and "the op's own error" in where
    import attnres_fx.models
    import attnres_fx.capture.tracers
    assert diagnostics.is_user_code(attnres_fx.models.__file__)        # the built-in models are models
    assert not diagnostics.is_user_code(attnres_fx.capture.tracers.__file__)
    report = 'from user code:\n  File "/home/u/model.py", line 7, in forward\n    return x + y\n'
    assert diagnostics.reported_user_frame(RuntimeError(report)) == "model.py:7 (return x + y)"
