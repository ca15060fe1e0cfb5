"""A simulated run never empties a file it means to overwrite.

``open(path, "w")`` (or ``"wb"``, ``"w+"``) empties an existing file at once, before the
code writes anything: a checkpoint saved as ``with open("model.pt", "wb") as f:
torch.save(model, f)`` is then left empty by a simulation, whose ``torch.save`` of
simulated tensors writes nothing (:mod:`.compat`). While a simulated run is installed, an
existing file with data that is opened to be overwritten is written beside itself instead:
what the run writes replaces it when the file is closed (as the write would have); closed
with nothing written, the file stays as it was, and the report says so. New files, and
files opened to append or update, are opened as asked.

Known limitations: only Python's ``open`` (builtins, ``io``, and so ``pathlib``) is
covered; ``os.open`` with ``O_TRUNC`` and C code that opens files itself empty as they
would. The command line (``python -m memmagic run``) keeps every change off the disk
(:mod:`memmagic.frontends.scratchdisk`), whose ``open`` is then the one a script calls.
"""

from __future__ import annotations

import builtins
import io
import os
import shutil
import tempfile
from typing import Any, Callable

from ...core.patching import Patches

__all__ = ["keep_overwritten_files"]


class KeptFile:
    """The file object for an existing file opened to be overwritten in a simulated run:
    the writes go to a new file in the same folder, which replaces the original when this
    is closed with data in it. ``name`` is the path the code opened."""

    def __init__(self, path: Any, mode: str, opener: Callable[..., Any], args: tuple,
                 kwargs: dict, kept: list[str]) -> None:
        self.name = path
        self._path = os.fspath(path)
        self._kept = kept
        fd, self._new = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(self._path)),
                                         prefix=".memmagic-")
        os.close(fd)
        try:
            self._file = opener(self._new, mode, *args, **kwargs)
        except BaseException:
            os.remove(self._new)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __iter__(self):
        return iter(self._file)

    def __enter__(self) -> "KeptFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close it: what was written replaces the original; nothing written, the
        original stays."""
        if self._file.closed:
            return
        self._file.close()
        if os.path.getsize(self._new) > 0:
            shutil.copymode(self._path, self._new)
            os.replace(self._new, self._path)
        else:
            os.remove(self._new)
            self._kept.append(self._path)

    def __del__(self) -> None:  # as a file object dropped unclosed: closed, its data kept
        try:
            self.close()
        except Exception:
            pass


def _overwrites_data(file: Any, mode: Any) -> bool:
    """Whether ``open(file, mode)`` would empty a file that holds data."""
    if not isinstance(mode, str) or "w" not in mode:
        return False
    if not isinstance(file, (str, bytes, os.PathLike)):
        return False
    try:
        return os.path.isfile(file) and os.path.getsize(file) > 0
    except (OSError, ValueError):
        return False


def keep_overwritten_files(patches: Patches, notes: list[str]) -> None:
    """While ``patches`` holds, ``open`` writes an existing file with data beside itself
    (see the module docstring); at the end a note names the files left as they were."""
    original = io.open
    kept: list[str] = []

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if _overwrites_data(file, mode):
            try:
                return KeptFile(file, mode, original, args, kwargs, kept)
            except OSError:  # no room beside it (a folder it cannot write): as asked
                pass
        return original(file, mode, *args, **kwargs)

    def say() -> None:
        if kept:
            names = ", ".join(sorted(set(kept)))
            notes.append(f"{names}: opened to be overwritten and nothing written into it (a "
                         "torch.save of simulated tensors writes nothing): left as it was")

    patches.call_on_restore(say)
    patches.set(builtins, "open", open_)
    patches.set(io, "open", open_)
