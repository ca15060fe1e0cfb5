"""Python's own ways to the disk, replaced while a script runs: ``open`` (builtins and io),
``io.FileIO``, the ``os`` functions that take a path, and ``shutil.rmtree`` (its fd-based
walk would miss the view). The rest of the standard library (``os.makedirs``,
``os.walk``, ``os.path``, ``pathlib``, ``glob``, ``tempfile``, ``shutil``'s copies and
moves) calls these through the ``os`` module, so it follows.

Outside a run (a reference kept past it) each replacement calls the function it replaced.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import posix
import shutil
import stat
import sys
from typing import Any, Callable

import _io

from ...core.patching import Patches
from .installed import current
from .view import path_error

__all__ = ["install"]

_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_TMPFILE = getattr(os, "O_TMPFILE", 0)
_NO_DIR_FD = "give it a path instead of a directory descriptor (dir_fd=)"

# os functions replaced by the method of the same name (those this platform has)
_OS_NAMES = ("open", "stat", "lstat", "access", "listdir", "scandir", "readlink", "getcwd",
             "getcwdb", "chdir", "mkdir", "rmdir", "remove", "unlink", "rename", "replace",
             "chmod", "lchmod", "chown", "lchown", "fchmod", "fchown", "ftruncate", "utime",
             "truncate", "symlink", "link", "mkfifo", "mknod", "setxattr", "removexattr",
             "getxattr", "listxattr", "statvfs", "chroot", "chflags", "lchflags")


def _named(fn: Callable, where: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(where, ...)`` with an error naming ``path``, the name the script used."""
    try:
        return fn(where, *args, **kwargs)
    except OSError as exc:
        if exc.filename == where and where is not path:
            exc.filename = path
        raise


def _parent(key: str) -> str:
    return os.path.dirname(key)


class OsCalls:
    """The replacements, over the :class:`~memmagic.frontends.scratchdisk.ScratchDisk` installed
    now (one instance for the process: what a module bound in one run serves the next)."""

    def __init__(self, rmtree: Callable) -> None:
        self.original_rmtree = rmtree

    @property
    def disk(self) -> Any:
        return current()

    @property
    def view(self) -> Any:
        return current().view

    def _direct(self, path: Any, dir_fd: Any = None) -> bool:
        """Whether a read of ``path`` goes straight to the disk (nothing changed yet, a
        descriptor, or no run)."""
        return (not self.disk.active or dir_fd is not None or isinstance(path, int)
                or self.view.clean)

    def _no_dir_fd(self, name: str, path: Any, *fds: Any) -> None:
        if any(fd is not None for fd in fds):
            self.disk.refuse(f"called os.{name}({path!r}, dir_fd=...)", hint=_NO_DIR_FD)

    def _on_fd(self, name: str, fd: int, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        if not self.disk.fd_in_scratch(fd):
            self.disk.refuse(f"called os.{name}() on descriptor {fd}, a file on the disk")
        return fn(fd, *args, **kwargs)

    # -- open ---------------------------------------------------------------------------------
    def to_open(self, file: Any, mode: Any) -> Any:
        """What ``open(file, mode)`` opens: the twin when it writes."""
        if not isinstance(mode, str) or not any(c in mode for c in "wax+"):
            return self.disk.readable(file)
        return self.disk.writable(file, keep="a" in mode or "r" in mode,
                                  create="r" not in mode, exclusive="x" in mode)

    def open(self, file: Any, mode: str = "r", buffering: int = -1, encoding: Any = None,
             errors: Any = None, newline: Any = None, closefd: bool = True,
             opener: Any = None) -> Any:
        if self.disk.active and not isinstance(file, int) and opener is None:
            file = self.to_open(file, mode)  # (an opener opens through os.open)
        return _io.open(file, mode, buffering, encoding, errors, newline, closefd, opener)

    def os_open(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: Any = None) -> int:
        if not self.disk.active:
            return posix.open(path, flags, mode, dir_fd=dir_fd)
        if dir_fd is not None:
            if flags & _WRITES:
                self._no_dir_fd("open", path, dir_fd)
            return posix.open(path, flags, mode, dir_fd=dir_fd)
        follow = not flags & os.O_NOFOLLOW
        if not flags & _WRITES:
            return _named(posix.open, self.disk.readable(path, follow), path, flags, mode)
        if _TMPFILE and flags & _TMPFILE == _TMPFILE:  # a nameless file in a directory
            key = self.view.key(path)
            self.view.require_dir(key, path)
            self.view.make_container(key)
            return posix.open(self.view.twin(key), flags, mode)
        twin = self.disk.writable(path, keep=not flags & os.O_TRUNC,
                                  create=bool(flags & os.O_CREAT),
                                  exclusive=bool(flags & os.O_CREAT and flags & os.O_EXCL),
                                  follow=follow)
        return _named(posix.open, twin, path, flags, mode)

    # -- reads --------------------------------------------------------------------------------
    def stat(self, path: Any, *, dir_fd: Any = None, follow_symlinks: bool = True) -> Any:
        if self._direct(path, dir_fd):
            return posix.stat(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        where = self.disk.readable(path, follow_symlinks)
        return _named(posix.stat, where, path, follow_symlinks=follow_symlinks)

    def lstat(self, path: Any, *, dir_fd: Any = None) -> Any:
        return self.stat(path, dir_fd=dir_fd, follow_symlinks=False)

    def access(self, path: Any, mode: int, *, dir_fd: Any = None, effective_ids: bool = False,
               follow_symlinks: bool = True) -> bool:
        if self._direct(path, dir_fd):
            return posix.access(path, mode, dir_fd=dir_fd, effective_ids=effective_ids,
                                follow_symlinks=follow_symlinks)
        try:
            where = self.disk.readable(path, follow_symlinks)
        except OSError:
            return False
        return posix.access(where, mode, effective_ids=effective_ids,
                            follow_symlinks=follow_symlinks)

    def readlink(self, path: Any, *, dir_fd: Any = None) -> Any:
        if self._direct(path, dir_fd):
            return posix.readlink(path, dir_fd=dir_fd)
        target = _named(posix.readlink, self.disk.readable(path, False), path)
        return os.fsencode(target) if isinstance(os.fspath(path), bytes) else target

    def _read(self, fn: Callable, path: Any, *args: Any, **kwargs: Any) -> Any:
        if self._direct(path) or path is None:
            return fn(path, *args, **kwargs)
        follow = kwargs.get("follow_symlinks", True)
        return _named(fn, self.disk.readable(path, follow), path, *args, **kwargs)

    def getxattr(self, path: Any, attribute: Any, *, follow_symlinks: bool = True) -> bytes:
        return self._read(posix.getxattr, path, attribute, follow_symlinks=follow_symlinks)

    def listxattr(self, path: Any = None, *, follow_symlinks: bool = True) -> list:
        return self._read(posix.listxattr, path, follow_symlinks=follow_symlinks)

    def statvfs(self, path: Any) -> Any:
        return self._read(posix.statvfs, path)

    def _directory(self, path: Any) -> tuple[Any, str]:
        p = "." if path is None else path
        key = self.view.key(p)
        self.view.require_dir(key, p)
        return p, key

    def listdir(self, path: Any = None) -> list:
        if self._direct(path):
            return posix.listdir(path)
        p, key = self._directory(path)
        names = self.view.names(key)
        return [os.fsencode(n) for n in names] if isinstance(os.fspath(p), bytes) else names

    def scandir(self, path: Any = None) -> Any:
        if self._direct(path):
            return posix.scandir(path)
        p, key = self._directory(path)
        return _ScanDir(self, p, self.view.names(key))

    def getcwd(self) -> str:
        return self.view.cwd() if self.disk.active else posix.getcwd()

    def getcwdb(self) -> bytes:
        return os.fsencode(self.getcwd())

    def chdir(self, path: Any) -> None:
        if self._direct(path):
            return posix.chdir(path)
        key = self.view.key(path)
        self.view.require_dir(key, path)
        return _named(posix.chdir, self.view.locate(key), path)

    # -- new entries ---------------------------------------------------------------------------
    def _create(self, path: Any, make: Callable[[str], None], kind: str = "file") -> None:
        """Make a new entry at ``path`` (FileExistsError when there is one): ``make(twin)``."""
        view = self.view
        key = view.key(path, follow=False)
        if view.exists(key):
            raise path_error(errno.EEXIST, path)
        view.require_dir(_parent(key), path)
        view.create(key, lambda twin: _named(make, twin, path))
        self.disk.changes.wrote(key, existed=False, kind=kind)

    def mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: Any = None) -> None:
        if not self.disk.active:
            return posix.mkdir(path, mode, dir_fd=dir_fd)
        self._no_dir_fd("mkdir", path, dir_fd)
        self._create(path, lambda twin: posix.mkdir(twin, mode), kind="dir")

    def symlink(self, src: Any, dst: Any, target_is_directory: bool = False, *,
                dir_fd: Any = None) -> None:
        if not self.disk.active:
            return posix.symlink(src, dst, target_is_directory, dir_fd=dir_fd)
        self._no_dir_fd("symlink", dst, dir_fd)
        self._create(dst, lambda twin: posix.symlink(src, twin))

    def mkfifo(self, path: Any, mode: int = 0o666, *, dir_fd: Any = None) -> None:
        if not self.disk.active:
            return posix.mkfifo(path, mode, dir_fd=dir_fd)
        self._no_dir_fd("mkfifo", path, dir_fd)
        self._create(path, lambda twin: posix.mkfifo(twin, mode))

    def mknod(self, path: Any, mode: int = 0o600, device: int = 0, *, dir_fd: Any = None) -> None:
        if not self.disk.active:
            return posix.mknod(path, mode, device, dir_fd=dir_fd)
        self._no_dir_fd("mknod", path, dir_fd)
        self._create(path, lambda twin: posix.mknod(twin, mode, device))

    def link(self, src: Any, dst: Any, *, src_dir_fd: Any = None, dst_dir_fd: Any = None,
             follow_symlinks: bool = True) -> None:
        if not self.disk.active:
            return posix.link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd,
                              follow_symlinks=follow_symlinks)
        self._no_dir_fd("link", src, src_dir_fd, dst_dir_fd)
        key = self.view.key(src, follow_symlinks)
        if not self.view.exists(key):
            raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), src, None, dst)
        self._create(dst, lambda twin: posix.link(self.view.materialize(key), twin,
                                                  follow_symlinks=follow_symlinks))

    # -- removing and renaming -------------------------------------------------------------------
    def _existing(self, path: Any) -> tuple[str, os.stat_result]:
        key = self.view.key(path, follow=False)
        s = self.view.lstat(key)
        if s is None:
            raise path_error(errno.ENOENT, path)
        return key, s

    def _remove(self, key: str) -> None:
        self.view.remove(key)
        self.disk.changes.deleted(key)

    def unlink(self, path: Any, *, dir_fd: Any = None) -> None:
        if not self.disk.active:
            return posix.unlink(path, dir_fd=dir_fd)
        self._no_dir_fd("unlink", path, dir_fd)
        key, s = self._existing(path)
        if stat.S_ISDIR(s.st_mode):
            raise path_error(errno.EISDIR, path)
        self._remove(key)

    remove = unlink

    def rmdir(self, path: Any, *, dir_fd: Any = None) -> None:
        if not self.disk.active:
            return posix.rmdir(path, dir_fd=dir_fd)
        self._no_dir_fd("rmdir", path, dir_fd)
        key, s = self._existing(path)
        if not stat.S_ISDIR(s.st_mode):
            raise path_error(errno.ENOTDIR, path)
        if self.view.names(key):
            raise path_error(errno.ENOTEMPTY, path)
        self._remove(key)

    def rmtree(self, path: Any, ignore_errors: bool = False, onerror: Any = None, *,
               onexc: Any = None, dir_fd: Any = None) -> None:
        if not self.disk.active:
            more = {} if onexc is None else {"onexc": onexc}
            return self.original_rmtree(path, ignore_errors, onerror, dir_fd=dir_fd, **more)
        self._no_dir_fd("rmtree", path, dir_fd)
        try:
            key, s = self._existing(path)
            if stat.S_ISLNK(s.st_mode):
                raise OSError("Cannot call rmtree on a symbolic link")
            if not stat.S_ISDIR(s.st_mode):
                raise path_error(errno.ENOTDIR, path)
        except OSError as exc:
            if ignore_errors:
                return None
            if onexc is not None:
                return onexc(os.lstat, path, exc)
            if onerror is not None:
                return onerror(os.lstat, path, sys.exc_info())
            raise
        self._remove(key)

    def rename(self, src: Any, dst: Any, *, src_dir_fd: Any = None,
               dst_dir_fd: Any = None) -> None:
        if not self.disk.active:
            return posix.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        self._no_dir_fd("rename", src, src_dir_fd, dst_dir_fd)
        view = self.view
        s, d = view.key(src, follow=False), view.key(dst, follow=False)
        if view.lstat(s) is None:
            raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), src, None, dst)
        if s == d:
            return None
        if d.startswith(s.rstrip("/") + "/"):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), src, None, dst)
        view.require_dir(_parent(d), dst)
        if view.lstat(d) is not None:
            self._replacing(s, d, dst)
            view.remove(d)
        view.move(s, d)
        self.disk.changes.renamed(s, d)

    replace = rename

    def _replacing(self, src: str, dst: str, path: Any) -> None:
        """The kernel's errors for a rename onto the existing ``dst``."""
        src_dir = stat.S_ISDIR(self.view.lstat(src).st_mode)
        dst_dir = stat.S_ISDIR(self.view.lstat(dst).st_mode)
        if src_dir and not dst_dir:
            raise path_error(errno.ENOTDIR, path)
        if dst_dir and not src_dir:
            raise path_error(errno.EISDIR, path)
        if dst_dir and self.view.names(dst):
            raise path_error(errno.ENOTEMPTY, path)

    # -- changes to an existing entry ----------------------------------------------------------
    def _change(self, name: str, path: Any, follow: bool, fn: Callable, *args: Any,
                **kwargs: Any) -> Any:
        """``fn(twin, ...)`` on the twin of ``path`` (copied up), or on a descriptor."""
        if isinstance(path, int):
            return self._on_fd(name, path, fn, *args, **kwargs)
        key = self.view.key(path, follow)
        if not self.view.exists(key):
            raise path_error(errno.ENOENT, path)
        out = _named(fn, self.view.materialize(key), path, *args, **kwargs)
        self.disk.changes.changed(key)
        return out

    def chmod(self, path: Any, mode: int, *, dir_fd: Any = None,
              follow_symlinks: bool = True) -> None:
        if not self.disk.active:
            return posix.chmod(path, mode, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        self._no_dir_fd("chmod", path, dir_fd)
        return self._change("chmod", path, follow_symlinks, posix.chmod, mode,
                            follow_symlinks=follow_symlinks)

    def lchmod(self, path: Any, mode: int) -> None:
        return self.chmod(path, mode, follow_symlinks=False)

    def chown(self, path: Any, uid: int, gid: int, *, dir_fd: Any = None,
              follow_symlinks: bool = True) -> None:
        if not self.disk.active:
            return posix.chown(path, uid, gid, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        self._no_dir_fd("chown", path, dir_fd)
        return self._change("chown", path, follow_symlinks, posix.chown, uid, gid,
                            follow_symlinks=follow_symlinks)

    def lchown(self, path: Any, uid: int, gid: int) -> None:
        return self.chown(path, uid, gid, follow_symlinks=False)

    def utime(self, path: Any, times: Any = None, *, ns: Any = None, dir_fd: Any = None,
              follow_symlinks: bool = True) -> None:
        more = {} if ns is None else {"ns": ns}
        if not self.disk.active:
            return posix.utime(path, times, dir_fd=dir_fd, follow_symlinks=follow_symlinks,
                               **more)
        self._no_dir_fd("utime", path, dir_fd)
        if isinstance(path, int):
            return self._on_fd("utime", path, posix.utime, times, **more)
        return self._change("utime", path, follow_symlinks, posix.utime, times,
                            follow_symlinks=follow_symlinks, **more)

    def setxattr(self, path: Any, attribute: Any, value: bytes, flags: int = 0, *,
                 follow_symlinks: bool = True) -> None:
        if not self.disk.active:
            return posix.setxattr(path, attribute, value, flags, follow_symlinks=follow_symlinks)
        return self._change("setxattr", path, follow_symlinks, posix.setxattr, attribute,
                            value, flags, follow_symlinks=follow_symlinks)

    def removexattr(self, path: Any, attribute: Any, *, follow_symlinks: bool = True) -> None:
        if not self.disk.active:
            return posix.removexattr(path, attribute, follow_symlinks=follow_symlinks)
        return self._change("removexattr", path, follow_symlinks, posix.removexattr,
                            attribute, follow_symlinks=follow_symlinks)

    def truncate(self, path: Any, length: int) -> None:
        if not self.disk.active:
            return posix.truncate(path, length)
        if isinstance(path, int):
            return self._on_fd("truncate", path, posix.truncate, length)
        twin = self.disk.writable(path, keep=True, create=False)
        return _named(posix.truncate, twin, path, length)

    def fchmod(self, fd: int, mode: int) -> None:
        if not self.disk.active:
            return posix.fchmod(fd, mode)
        return self._on_fd("fchmod", fd, posix.fchmod, mode)

    def fchown(self, fd: int, uid: int, gid: int) -> None:
        if not self.disk.active:
            return posix.fchown(fd, uid, gid)
        return self._on_fd("fchown", fd, posix.fchown, uid, gid)

    def ftruncate(self, fd: int, length: int) -> None:
        if not self.disk.active:
            return posix.ftruncate(fd, length)
        return self._on_fd("ftruncate", fd, posix.ftruncate, length)

    def chroot(self, path: Any) -> None:
        if self.disk.active:
            self.disk.refuse(f"called os.chroot({path!r})")
        return posix.chroot(path)

    def chflags(self, path: Any, flags: int, follow_symlinks: bool = True) -> None:
        self.disk.refuse(f"called os.chflags({path!r})")

    def lchflags(self, path: Any, flags: int) -> None:
        self.disk.refuse(f"called os.lchflags({path!r})")


class _ScanDir:
    """``os.scandir``'s iterator (also a context manager) over the view's entries."""

    def __init__(self, calls: OsCalls, directory: Any, names: list[str]) -> None:
        self._entries = iter([_Entry(calls, directory, name) for name in names])

    def __iter__(self) -> _ScanDir:
        return self

    def __next__(self) -> _Entry:
        return next(self._entries)

    def __enter__(self) -> _ScanDir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._entries = iter(())


class _Entry:
    """``os.DirEntry``'s interface, answered by the view."""

    def __init__(self, calls: OsCalls, directory: Any, name: str) -> None:
        directory = os.fspath(directory)
        self.name = os.fsencode(name) if isinstance(directory, bytes) else name
        self.path = os.path.join(directory, self.name)
        self._calls = calls
        self._stats: dict[bool, Any] = {}

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        if follow_symlinks not in self._stats:
            self._stats[follow_symlinks] = self._calls.stat(self.path,
                                                            follow_symlinks=follow_symlinks)
        return self._stats[follow_symlinks]

    def _mode(self, follow: bool) -> int:
        try:
            return self.stat(follow_symlinks=follow).st_mode
        except OSError:
            return 0

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        return stat.S_ISDIR(self._mode(follow_symlinks))

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        return stat.S_ISREG(self._mode(follow_symlinks))

    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self._mode(False))

    def is_junction(self) -> bool:
        return False

    def inode(self) -> int:
        return self.stat(follow_symlinks=False).st_ino

    def __fspath__(self) -> Any:
        return self.path

    def __repr__(self) -> str:
        return f"<DirEntry {self.name!r}>"


def _file_io_class(calls: OsCalls) -> type:
    """``io.FileIO`` opening through the view; ``isinstance`` answers as for the real one."""

    class _SameAsFileIO(type):
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, _io.FileIO)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, _io.FileIO)

    class FileIO(_io.FileIO, metaclass=_SameAsFileIO):
        def __init__(self, file: Any, mode: str = "r", closefd: bool = True,
                     opener: Any = None) -> None:
            if calls.disk.active and not isinstance(file, int) and opener is None:
                file = calls.to_open(file, mode)
            super().__init__(file, mode, closefd, opener)

    FileIO.__module__ = "io"
    return FileIO


# names other modules bound to the built-in open when they were imported
_BOUND_OPEN = (("tarfile", "bltn_open"), ("bz2", "_builtin_open"))

OsCalls.rmtree.avoids_symlink_attacks = True  # type: ignore[attr-defined] # (as shutil's)
_CALLS = OsCalls(shutil.rmtree)
_FILE_IO = _file_io_class(_CALLS)


def install(patches: Patches) -> None:
    """Replace the functions for the run of the disk installed now (undone by
    ``patches.restore()``)."""
    calls = _CALLS
    for mod in (builtins, io):
        patches.set(mod, "open", calls.open)
    patches.set(io, "FileIO", _FILE_IO)
    for name in _OS_NAMES:
        if hasattr(os, name):
            patches.set(os, name, calls.os_open if name == "open" else getattr(calls, name))
    patches.set(shutil, "rmtree", calls.rmtree)
    for module_name, name in _BOUND_OPEN:
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, name, None) is _io.open:
            patches.set(module, name, calls.open)
