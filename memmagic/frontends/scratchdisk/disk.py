"""The scratch disk one run of a script sees: :class:`ScratchDisk`, its path-level
operations (what the replaced functions of :mod:`.oscalls` and :mod:`.libraries` share) and
the refusal of what cannot be kept off the disk."""

from __future__ import annotations

import contextlib
import errno
import os
import posix
import stat
import sys
import tempfile
from typing import Any, Iterator

from ...core.patching import Patches
from .changes import Changes, ChangeSummary
from .errors import RefusedCall
from .installed import INSTALLED
from .view import View, path_error, remove_tree

__all__ = ["ScratchDisk"]

KEEP_OFF = "memmagic run cannot keep off the disk"


def _after_fork_in_parent() -> None:
    disk = INSTALLED.disk
    if disk.active:
        disk.view.forked()


os.register_at_fork(after_in_parent=_after_fork_in_parent)


class ScratchDisk:
    """Files, directories and links the script writes, removes, renames or changes go to
    a scratch directory, removed after the run; the script sees the real disk with its
    changes over it (see :mod:`memmagic.frontends.scratchdisk`).

    ``with disk.installed(): ...`` runs its body over a fresh view; ``summary`` then says
    what the script changed (none of it on the disk). ``for_real``: the command that runs
    the script for real, which a refusal suggests."""

    def __init__(self, for_real: str = "python SCRIPT") -> None:
        self.for_real = for_real  # how the script runs for real, for the refusals' hints
        self.active = False
        self.view = View("/nonexistent")
        self.changes = Changes()
        self.summary = ChangeSummary()
        self.pid = os.getpid()

    @contextlib.contextmanager
    def installed(self) -> Iterator[ScratchDisk]:
        from . import libraries, oscalls, processes

        root = os.path.realpath(tempfile.mkdtemp(prefix="memmagic-scratch-"))
        self.view, self.changes, self.pid = View(root), Changes(), os.getpid()
        cwd = posix.getcwd()
        patches = Patches()
        try:
            patches.set(INSTALLED, "disk", self)
            oscalls.install(patches)
            libraries.install(patches)
            processes.install(patches)
            patches.set(sys, "dont_write_bytecode", True)  # imports write no __pycache__
            self.active = True
            yield self
        finally:
            self.active = False
            try:
                patches.restore()
            finally:
                self.summary = self.changes.summary()
                with contextlib.suppress(OSError):
                    posix.chdir(cwd)  # a script that changed directory, maybe into a twin
                remove_tree(root)

    # -- what the replaced functions share ----------------------------------------------------
    def refuse(self, what: str, why: str = KEEP_OFF, hint: str = "",
               error: type[BaseException] = RefusedCall) -> None:
        """Refuse what the script is doing (``what``: "called os.mkfifo('f')"), before it
        changed anything: one line that says ``why`` and what to do (``hint``; default: run
        it without that, or for real), raised as ``error``. In a process the script
        forked, a RefusedCall becomes a PermissionError, which multiprocessing hands back
        to the script's process."""
        hint = hint or f"run the script without it, or for real ({self.for_real})"
        message = f"the script {what}, which {why}: {hint}"
        self.changes.refused.append(what)
        if error is RefusedCall and os.getpid() != self.pid:
            raise PermissionError(errno.EPERM, message)
        raise error(errno.ENOENT, message) if issubclass(error, OSError) else error(message)

    def readable(self, path: Any, follow: bool = True) -> Any:
        """The path to read ``path`` through (FileNotFoundError: the script removed it)."""
        view = self.view
        if view.clean:
            return path
        where = view.locate(view.key(path, follow))
        if where is None:
            raise path_error(errno.ENOENT, path)
        return where

    def writable(self, path: Any, keep: bool, *, create: bool = True,
                 exclusive: bool = False, follow: bool = True) -> str:
        """The twin to write ``path`` through, made as the kernel would open it: ``keep``
        its contents (append, ``r+``) or start empty, ``create`` it when missing,
        ``exclusive``: FileExistsError when it exists."""
        view = self.view
        key = view.key(path, follow)
        s = view.lstat(key, follow=True)
        if s is not None and exclusive:
            raise path_error(errno.EEXIST, path)
        if s is None and not create:
            raise path_error(errno.ENOENT, path)
        if s is not None and stat.S_ISDIR(s.st_mode):
            raise path_error(errno.EISDIR, path)
        if s is None:
            view.require_dir(os.path.dirname(key), path)
        elif os.getuid() != 0 and not posix.access(view.locate(key), os.W_OK):
            raise path_error(errno.EACCES, path)
        twin = view.for_write(key, keep)
        self.changes.wrote(key, existed=s is not None)
        return twin

    def fd_in_scratch(self, fd: int) -> bool:
        """Whether changing what the descriptor ``fd`` refers to leaves the disk alone: a
        twin, a pipe or socket, a device (Linux: from /proc; elsewhere only non-files)."""
        try:
            target = posix.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            try:
                mode = posix.fstat(fd).st_mode
            except OSError:
                return True  # a bad descriptor: the call fails on its own
            return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))
        root = self.view.root
        return (not target.startswith("/") or target.startswith(("/dev/", "/memfd:"))
                or target == root or target.startswith(root + "/"))
