"""Writing a user's file or folder so that it is either fully replaced or left exactly as it was.

Everything is first written into a temporary sibling of the target (same folder, so the same file system:
a rename, not a copy, puts it in place), checked there, and then moved in:

- a file (:func:`replaced_files`, for a file and the companions written beside it, an ONNX model and its
  ``.data``): each old file is renamed aside, each new one renamed in, the old ones deleted;
- a folder (:func:`replaced_folder`): the old folder renamed aside, the new one renamed in, the old one
  deleted; files of the old folder that the new one does not write (a tokenizer saved beside a model) are
  carried over unless ``drop`` claims them.

A failure, an interrupt (``KeyboardInterrupt``) included, before the new files are all in place puts the
old ones back: the target is as before, and the temporary sibling is removed. An ``OSError`` becomes a
:class:`~attnres_fx.errors.WriteError` naming the target, the step and the cause ("the disk is full" for
``ENOSPC``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import WriteError

STAGING_PREFIX = ".attnres-tmp-"


# How writers in Rust (safetensors, tokenizers) report an I/O error in their own exception types.
_RUST_IO_ERROR = re.compile(r"\(os error (\d+)\)")


def error_number(err: BaseException) -> int | None:
    """The ``errno`` of a failed write: an ``OSError``'s, or the one a Rust writer's message names."""
    if isinstance(err, OSError):
        return err.errno
    found = _RUST_IO_ERROR.search(str(err))
    return int(found.group(1)) if found else None


def cause(err: BaseException) -> str:
    """What went wrong, in words a user acts on."""
    if error_number(err) in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full ({err})"
    return f"{type(err).__name__}: {err}"


def write_error(target: Path, step: str, err: BaseException) -> WriteError:
    return WriteError(f"writing {target} failed while {step}: {cause(err)}. {target} is as it was before; "
                      "free the space (or fix the cause) and write it again", error_number(err))


@contextlib.contextmanager
def writing(target: str | os.PathLike, step: str) -> Iterator[None]:
    """Within: an ``OSError`` (or a Rust writer's I/O error) becomes a :class:`WriteError` naming
    ``target`` and ``step``."""
    try:
        yield
    except WriteError:
        raise
    except Exception as err:
        if not isinstance(err, OSError) and error_number(err) is None:
            raise
        raise write_error(Path(target), step, err) from err


@contextlib.contextmanager
def _staging(target: Path) -> Iterator[Path]:
    """A fresh empty folder beside ``target``, removed on the way out whatever happens."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f"{STAGING_PREFIX}{target.name}-"))
    except OSError as err:
        raise write_error(target, f"making a temporary folder in {target.parent}", err) from err
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def replaced_files(target: str | os.PathLike, companions: Callable[[Path], list[Path]] = lambda path: [path]
                   ) -> Iterator[Path]:
    """Within: a path to write ``target``'s new file at (in a temporary folder beside it, under
    ``target``'s own name, so that files that refer to each other by name keep doing so). On leaving
    without an error, ``companions(path)`` (the file itself and whatever is written beside it, e.g.
    ``model.onnx.data``) replace those of the target's name; companions that the new file does not have
    are deleted from beside the target, since they belong to the old one."""
    target = Path(target)
    with _staging(target) as staging:
        yield staging / target.name
        new = companions(staging / target.name)
        old = [target.parent / path.name for path in companions(target)]
        _swap(target, [(path, target.parent / path.name) for path in new if path.exists()],
              [path for path in old if path.exists() or path.is_symlink()], staging)


def _swap(target: Path, moves: list[tuple[Path, Path]], olds: list[Path], staging: Path) -> None:
    """Rename every old file aside (into ``staging``), every new one in; undo all on any failure. Each
    move is noted before it is made, so that an interrupt right after a rename is undone too."""
    aside: list[tuple[Path, Path]] = []
    placed: list[Path] = []
    try:
        for old in olds:
            kept = staging / f"{STAGING_PREFIX}old-{old.name}"
            aside.append((kept, old))
            os.replace(old, kept)
        for new, destination in moves:
            placed.append(destination)
            os.replace(new, destination)
    except BaseException as err:
        for destination in placed:
            with contextlib.suppress(OSError):
                destination.unlink()
        for kept, old in aside:
            if kept.exists() or kept.is_symlink():
                os.replace(kept, old)
        if isinstance(err, OSError):
            raise write_error(target, "moving the new files in", err) from err
        raise


@contextlib.contextmanager
def replaced_folder(target: str | os.PathLike, drop: Callable[[str], bool] = lambda name: False) -> Iterator[Path]:
    """Within: an empty folder to write ``target``'s new contents into. On leaving without an error, the
    files of the old ``target`` that the new folder lacks and ``drop(name)`` does not claim are linked (or
    copied) in, and the new folder replaces the old in two renames; the old is then deleted."""
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise WriteError(f"{target} is a file, not a folder: nothing was written", errno.ENOTDIR)
    with _staging(target) as staging:
        content = staging / target.name
        content.mkdir()
        yield content
        if target.is_dir():
            for item in target.iterdir():
                if not (content / item.name).exists() and not drop(item.name):
                    _carry(item, content / item.name, target)
        aside = staging / f"{STAGING_PREFIX}old"
        try:
            if target.is_dir():
                os.replace(target, aside)
            os.replace(content, target)
        except BaseException as err:
            # Whether or not the rename that was interrupted had happened: the old folder goes back.
            if aside.exists() and not target.exists():
                os.replace(aside, target)
            if isinstance(err, OSError):
                raise write_error(target, "moving the new folder in", err) from err
            raise


def _carry(item: Path, into: Path, target: Path) -> None:
    """``item`` of the old folder into the new one: a hard link where the file system allows (the old
    file is never written to again), else a copy."""
    try:
        if item.is_dir() and not item.is_symlink():
            shutil.copytree(item, into, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(item, into)
    except OSError as err:
        raise write_error(target, f"carrying {item.name} over from the old folder", err) from err


def _link_or_copy(source, destination) -> None:
    if Path(source).is_symlink():
        os.symlink(os.readlink(source), destination)
        return
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)
