"""How attnres_fx reads a failure it reports: the chain of exceptions, its root cause, its first line,
and the line of the user's code where it arose.

An exception's chain follows ``__cause__``, then ``__context__``, also where ``raise ... from None``
suppressed it (Python's traceback printing hides it): Dynamo raises its ``TorchRuntimeError`` that way,
and the suppressed context is the op's own error, the one that names the problem. The user's code is
every frame outside torch and attnres_fx's machinery (its built-in models, :mod:`attnres_fx.models`,
count as the user's).
"""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Iterator

import torch

MAX_CAUSE_LINES = 12
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_MACHINERY = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, _PACKAGE + os.sep,
              os.path.join(os.path.dirname(_PACKAGE), "passes") + os.sep,
              os.path.join(os.path.dirname(_PACKAGE), "export") + os.sep)
_BUILT_IN_MODELS = os.path.join(_PACKAGE, "models.py")


def is_user_code(filename: str) -> bool:
    path = os.path.abspath(filename)
    return not filename.startswith("<") and (path == _BUILT_IN_MODELS or not path.startswith(_MACHINERY))

_REPORTED_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in \S+$')


def chain(err: BaseException) -> Iterator[BaseException]:
    """``err`` and the exceptions it was raised from or during, outermost first."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def root_cause(err: BaseException) -> BaseException:
    """The innermost exception of ``err``'s chain (Dynamo and the exporters wrap the real one)."""
    *_, innermost = chain(err)
    return innermost


def first_line(err: BaseException) -> str:
    """The first line of the message, or the exception's repr when its message is empty."""
    text = str(err).strip()
    return text.splitlines()[0] if text else repr(err)


def describe(err: BaseException) -> str:
    """``Type: first paragraph of the message`` of the root cause, at most MAX_CAUSE_LINES lines."""
    cause = root_cause(err)
    text = str(cause).strip().split("\n\n")[0]
    lines = text.splitlines() or [repr(cause)]
    if len(lines) > MAX_CAUSE_LINES:
        lines = lines[:MAX_CAUSE_LINES] + ["..."]
    return f"{type(cause).__name__}: " + "\n".join(lines)


def user_frame(err: BaseException) -> str | None:
    """``file:line: code`` of the innermost frame of the user's code where the root cause was raised:
    its traceback, then the frames Dynamo was tracing (``real_stack``); None when there is none."""
    cause = root_cause(err)
    frames = [*traceback.extract_tb(cause.__traceback__), *(getattr(cause, "real_stack", None) or [])]
    frames = [f for f in frames if is_user_code(f.filename)]
    if not frames:
        return None
    return f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}"


def reported_user_frame(err: BaseException) -> str | None:
    """``file:line (code)`` of the innermost line of the user's code that a Dynamo report quotes in its
    message ("from user code: File ..., line ..."), where no traceback holds it."""
    lines = str(err).splitlines()
    found = None
    for number, text in enumerate(lines):
        frame = _REPORTED_FRAME.match(text)
        if frame and is_user_code(frame.group(1)):
            code = lines[number + 1].strip() if number + 1 < len(lines) else ""
            found = f"{os.path.basename(frame.group(1))}:{frame.group(2)}"
            if code and not _REPORTED_FRAME.match(lines[number + 1]):
                found += f" ({code})"
    return found
