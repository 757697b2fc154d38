"""Writing a user's file or folder so that it is either fully replaced or left exactly as it was.

Everything is first written into a temporary sibling of the target (same folder, so the same file system:
a rename, not a copy, puts it in place), checked there, and then moved in:

- a file (:func:`replaced_files`, for a file and the companions written beside it, an ONNX model and its
  ``.data``): each old file is renamed aside, each new one renamed in, the old ones deleted;
- a folder (:func:`replaced_folder`): the old folder renamed aside, the new one renamed in, the old one
  deleted; files of the old folder that the new one does not write (a tokenizer saved beside a model) are
  carried over unless ``drop`` claims them.

A target that is a symbolic link is written through it: the file or folder it points to is replaced, the
link stays. A target that cannot be renamed (a mount point: ``EBUSY``) or whose parent cannot be written
to (a writable folder in a read-only one) is written in place instead, file by file as transformers
writes, with a warning that an interruption can then leave a mix.

A failure, an interrupt (``KeyboardInterrupt``) included, before the new files are all in place puts the
old ones back: the target is as before, and the temporary sibling is removed. An ``OSError`` becomes a
:class:`~attnres_fx.errors.WriteError` naming the target, the step and the cause ("the disk is full" for
``ENOSPC``).

A process killed part-way leaves its temporary sibling behind. Before the renames begin, the writer notes
in it what they are (``.attnres-tmp-ready``): :func:`recover`, which every write and
``attnres_fx.from_pretrained`` call first, finishes the moves of a folder so noted (its new content was
complete and checked) and deletes any other leftover; a folder whose writer is still at work (it holds a
lock on it) is left alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import AttnResWarning, WriteError

STAGING_PREFIX = ".attnres-tmp-"
# In a staging folder: the moves that put its content in place, written once that content is complete.
READY_NAME = f"{STAGING_PREFIX}ready"
# The characters and length of tempfile.mkdtemp's random suffix.
_STAGING_SUFFIX = r"[a-z0-9_]{8}"
# Renaming the target fails with these where writing into it works: a mount point, a folder whose parent
# is read-only.
_NO_SWAP = (errno.EBUSY, errno.EACCES, errno.EPERM, errno.EROFS, errno.EXDEV)


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


def written_path(target: str | os.PathLike) -> Path:
    """Where a write of ``target`` goes: symbolic links followed (to where a dangling one points), as
    ``open`` and transformers' writes follow them."""
    return Path(os.path.realpath(target))


def _staging_prefix(target: Path) -> str:
    return f"{STAGING_PREFIX}{target.name}-"


def _lock(folder: Path, wait: bool) -> int | None:
    """An open descriptor of ``folder`` holding an exclusive ``flock`` on it (released when it is closed,
    or when the process dies), or None where another holds it and ``wait`` is False."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        return None
    return descriptor


def _new_staging(where: Path, target: Path) -> tuple[Path, int]:
    """A fresh empty folder in ``where``, locked: :func:`recover` in another process may delete an
    unlocked one between its creation and the lock, so a folder gone by then is made anew."""
    while True:
        staging = Path(tempfile.mkdtemp(dir=where, prefix=_staging_prefix(target)))
        try:
            descriptor = _lock(staging, wait=True)
        except FileNotFoundError:
            continue
        with contextlib.suppress(FileNotFoundError):
            if os.stat(staging).st_ino == os.fstat(descriptor).st_ino:
                return staging, descriptor
        os.close(descriptor)


@contextlib.contextmanager
def _staging(target: Path, where: Path) -> Iterator[Path]:
    """A fresh empty folder in ``where`` for writing ``target``, locked and removed on the way out
    whatever happens."""
    try:
        where.mkdir(parents=True, exist_ok=True)
        staging, descriptor = _new_staging(where, target)
    except OSError as err:
        raise write_error(target, f"making a temporary folder in {where}", err) from err
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        os.close(descriptor)


def _note_moves(staging: Path, moves: list[tuple[str, Path]], deletions: list[Path]) -> None:
    """Write the moves (``staging``-relative source, destination) and deletions that put the complete
    content of ``staging`` in place, for :func:`recover` to finish should the process die during them.
    Destinations are noted relative to the folder that holds ``staging`` (they all lie in it): a folder
    moved or copied with its leftover is recovered where it is now, never into where it was."""
    where = staging.parent
    note = {"move": [[source, str(destination.relative_to(where))] for source, destination in moves],
            "delete": [str(path.relative_to(where)) for path in deletions]}
    (staging / READY_NAME).write_text(json.dumps(note))


def _noted(staging: Path, noted: str) -> Path:
    """A path of ``staging``'s note, relative as noted; a note naming anything outside the folder that
    holds ``staging`` is no note of ours (``ValueError``: the leftover is left alone)."""
    relative = Path(noted)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise ValueError(f"{staging / READY_NAME} names {noted!r}, outside {staging.parent}")
    return relative


def _refuse_folders(target: Path, paths: list[Path]) -> None:
    for path in paths:
        if path.is_dir():
            raise WriteError(f"{path} is a folder: nothing was written ({target} is a file, and writing it would "
                             "replace that folder). Give a file path where no folder is, or move the folder away "
                             "first", errno.EISDIR)


@contextlib.contextmanager
def replaced_files(target: str | os.PathLike, companions: Callable[[Path], list[Path]] = lambda path: [path]
                   ) -> Iterator[Path]:
    """Within: a path to write ``target``'s new file at (in a temporary folder beside it, under
    ``target``'s own name, so that files that refer to each other by name keep doing so). On leaving
    without an error, ``companions(path)`` (the file itself and whatever is written beside it, e.g.
    ``model.onnx.data``) replace those of the target's name; companions that the new file does not have
    are deleted from beside the target, since they belong to the old one. A folder at ``target`` or at
    a companion's path raises :class:`WriteError` before anything is written: it is never deleted."""
    target = written_path(target)
    _refuse_folders(target, companions(target))
    recover(target)
    with _staging(target, target.parent) as staging:
        yield staging / target.name
        new = [path for path in companions(staging / target.name) if path.exists()]
        old = [target.parent / path.name for path in companions(target)]
        _refuse_folders(target, old)
        olds = [path for path in old if path.exists() or path.is_symlink()]
        new_names = {path.name for path in new}
        _note_moves(staging, [(path.name, target.parent / path.name) for path in new],
                    [path for path in olds if path.name not in new_names])
        _swap(target, [(path, target.parent / path.name) for path in new], olds, staging)


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
    copied) in, and the new folder replaces the old in two renames; the old is then deleted. Where the
    target cannot be renamed or its parent written to, the new files are moved into it one by one, those
    of the old that ``drop`` claims and the new lacks deleted, with an :class:`AttnResWarning`."""
    target = written_path(target)
    if target.exists() and not target.is_dir():
        raise WriteError(f"{target} is a file, not a folder: nothing was written", errno.ENOTDIR)
    recover(target)
    with contextlib.ExitStack() as stack:
        try:
            staging, in_place = stack.enter_context(_staging(target, target.parent)), None
        except WriteError as err:
            if err.errno not in _NO_SWAP or not target.is_dir():
                raise
            # A folder that can be written to inside a parent that cannot: staged inside itself.
            staging = stack.enter_context(_staging(target, target))
            in_place = f"its parent {target.parent} cannot be written to ({cause(err.__cause__)})"
        content = _content(staging, target)
        yield content
        if in_place:
            _write_in_place(target, staging, drop, in_place)
            return
        carried = _carry_over(target, content, drop)
        aside = staging / f"{STAGING_PREFIX}old"
        _note_moves(staging, [(target.name, target)], [])
        try:
            if target.is_dir():
                os.replace(target, aside)
            os.replace(content, target)
        except BaseException as err:
            # Whether or not the rename that was interrupted had happened: the old folder goes back.
            if aside.exists() and not target.exists():
                os.replace(aside, target)
            if isinstance(err, OSError) and err.errno in _NO_SWAP and target.is_dir():
                for name in carried:
                    _remove(content / name)
                _write_in_place(target, staging, drop, f"renaming it failed: {cause(err)}")
                return
            if isinstance(err, OSError):
                raise write_error(target, "moving the new folder in", err) from err
            raise


def _content(staging: Path, target: Path) -> Path:
    content = staging / target.name
    content.mkdir()
    return content


def _carry_over(target: Path, content: Path, drop: Callable[[str], bool]) -> list[str]:
    """Link (or copy) into ``content`` the files of the old ``target`` that it lacks and ``drop`` does
    not claim; their names."""
    carried = []
    if target.is_dir():
        for item in target.iterdir():
            if not item.name.startswith(STAGING_PREFIX) and not (content / item.name).exists() and not drop(item.name):
                _carry(item, content / item.name, target)
                carried.append(item.name)
    return carried


def _write_in_place(target: Path, staging: Path, drop: Callable[[str], bool], why: str) -> None:
    """The complete new content in ``staging`` moved into ``target`` file by file, the old files that
    ``drop`` claims and the new lacks deleted: where the folder cannot be swapped whole."""
    content = staging / target.name
    names = sorted(item.name for item in content.iterdir())
    stale = [item for item in target.iterdir() if not item.name.startswith(STAGING_PREFIX)
             and drop(item.name) and item.name not in names]
    warnings.warn(f"{target} cannot be replaced whole ({why}): its files were written in place, one by one, as "
                  "transformers writes them; an interruption can leave old and new files side by side",
                  AttnResWarning, stacklevel=4)
    moves = [(f"{target.name}/{name}", target / name) for name in names]
    _note_moves(staging, moves, stale)
    with writing(target, "moving the new files in"):
        _finish(staging, moves, stale)


def _finish(staging: Path, moves: list[tuple[str, Path]], deletions: list[Path]) -> None:
    """Make the noted moves and deletions of ``staging`` that are still to be made (each one
    idempotent): a folder in the way is renamed aside into ``staging`` first."""
    for number, (source, destination) in enumerate(moves):
        source = staging / source
        if not (source.exists() or source.is_symlink()):
            continue
        if destination.is_dir() and not destination.is_symlink():
            os.replace(destination, staging / f"{STAGING_PREFIX}old-{number}")
        _move(source, destination)
    for path in deletions:
        _remove(path)


def _move(source: Path, destination: Path) -> None:
    """A rename; across file systems (the content of a mount point staged beside it) a copy beside the
    destination renamed over it, so that no file is ever half written."""
    try:
        os.replace(source, destination)
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
        copy = destination.with_name(f"{STAGING_PREFIX}{destination.name}")
        if source.is_dir() and not source.is_symlink():
            shutil.copytree(source, copy, symlinks=True)
        else:
            shutil.copy2(source, copy, follow_symlinks=False)
        os.replace(copy, destination)
        _remove(source)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def recover(target: str | os.PathLike) -> None:
    """Finish what a writer of ``target`` killed part-way left: in a temporary folder beside ``target``
    (or inside it, for a write in place) whose moves were noted as ready, the moves still to be made
    are made; every such folder whose writer is gone is then deleted. Errors are left to the write or
    load that follows: this never raises."""
    target = written_path(target)
    pattern = re.compile(re.escape(_staging_prefix(target)) + _STAGING_SUFFIX)
    for where in (target.parent, target):
        try:
            found = [path for path in where.iterdir() if pattern.fullmatch(path.name)]
        except OSError:
            continue
        for staging in found:
            with contextlib.suppress(OSError, ValueError):
                _recover_one(staging)


def _recover_one(staging: Path) -> None:
    if staging.is_symlink() or not staging.is_dir():
        return
    descriptor = _lock(staging, wait=False)
    if descriptor is None:
        return
    try:
        ready = staging / READY_NAME
        if ready.exists():
            note = json.loads(ready.read_text())
            where = staging.parent
            _finish(staging, [(str(_noted(staging, source)), where / _noted(staging, destination))
                              for source, destination in note["move"]],
                    [where / _noted(staging, path) for path in note["delete"]])
        shutil.rmtree(staging)
    finally:
        os.close(descriptor)


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
