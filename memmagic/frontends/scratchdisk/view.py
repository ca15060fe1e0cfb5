"""The script's view of the disk: the real disk as it is, with what the script changed laid
over it, kept in a scratch directory.

A path of the view is a *key*: absolute, normalised, its directories' symbolic links
resolved in the view. A key is found in this order:

* its **twin**, the file or directory at ``root + key`` in the scratch directory, which the
  script wrote, made, or changed (the real one copied there first);
* else what lies **under** it: a *whiteout* (``hidden``: a key the script removed, with all
  below it) hides the real path; an *origin* (a key the script renamed a real path to)
  shows that real path's contents, read-only, without copying them;
* else the real path itself, read-only.

A *container* is a twin directory made only to hold twins of a real directory's entries:
the real directory stays what the view shows (its mode, its times, its other entries).

Only the ``posix`` and ``_io`` functions are called here: never the patched ``os`` ones.
"""

from __future__ import annotations

import errno
import os
import posix
import posixpath
import stat
from typing import Any

import _io

__all__ = ["View", "path_error"]

_MAX_LINKS = 40  # the kernel's limit on links followed in one path (ELOOP)


def path_error(code: int, path: Any) -> OSError:
    """The OSError the kernel gives for ``code`` on ``path`` (FileNotFoundError, ...)."""
    return OSError(code, os.strerror(code), path)


def _lstat(path: str) -> os.stat_result | None:
    try:
        return posix.lstat(path)
    except OSError:
        return None


def _is_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(posix.stat(path).st_mode)
    except OSError:
        return False


def _mkdir(twin: str) -> None:
    """Make a twin directory; one a forked process of the script made meanwhile will do."""
    try:
        posix.mkdir(twin, 0o700)
    except FileExistsError:
        if not _is_dir(twin):
            raise


def _parent(key: str) -> str:
    return posixpath.dirname(key)


def _child(key: str, name: str) -> str:
    return key + name if key == "/" else f"{key}/{name}"


def _below(key: str) -> str:
    """The prefix of every key strictly below ``key``."""
    return "/" if key == "/" else key + "/"


def _normal(path: str) -> str:
    path = posixpath.normpath(path)
    return "/" + path.lstrip("/") if path.startswith("//") else path


class View:
    """The script's view over the scratch directory ``root`` (see the module docstring)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.hidden: set[str] = set()
        self.origin: dict[str, str] = {}
        self.containers: set[str] = {"/"}
        self.twin_dirs: set[str] = {"/"}  # keys whose twin is a directory: twins lie only there
        self.plain: set[str] = set()  # real paths known to be no symbolic link
        self.touched = False  # a twin was made
        self.shared = False  # forked processes may make twins this one does not know of

    def forked(self) -> None:
        """The script forked: its children write twins of their own (the same directory)."""
        self.shared = self.touched = True

    @property
    def clean(self) -> bool:
        """Nothing changed yet: every path is the real one."""
        return not (self.touched or self.hidden or self.origin)

    # -- keys -------------------------------------------------------------------------------
    def from_real(self, path: str) -> str:
        """``path``, or the key it stands for when it lies in the scratch directory (a
        twin's name the script got back, from ``f.name`` or ``os.getcwd()``)."""
        r = self.root
        if path.startswith(r) and (len(path) == len(r) or path[len(r)] == "/"):
            return path[len(r):] or "/"
        return path

    def cwd(self) -> str:
        return self.from_real(posix.getcwd())

    def absolute(self, path: Any) -> str:
        p = os.fsdecode(path)
        if not p.startswith("/"):
            p = f"{self.cwd()}/{p}"
        return self.from_real(_normal(p))

    def key(self, path: Any, follow: bool = True) -> str:
        """The key of ``path`` (``follow``: its last part's link resolved too)."""
        key = self.absolute(path)
        for _ in range(_MAX_LINKS):
            if key == "/":
                return key
            parts = key.split("/")
            end = len(parts) if follow else len(parts) - 1
            for i in range(1, end):
                prefix = "/".join(parts[:i + 1])
                target = self.link_target(prefix)
                if target is not None:
                    key = _normal(posixpath.join(_parent(prefix), target, *parts[i + 1:]))
                    break
            else:
                return key
        raise path_error(errno.ELOOP, path)

    def link_target(self, key: str) -> str | None:
        """What the view's link at ``key`` points to (None: not a link)."""
        where = self.locate(key)
        if where is None or where in self.plain:
            return None
        try:
            return posix.readlink(where)
        except OSError:
            if not where.startswith(self.root):  # the script does not change real paths
                self.plain.add(where)
            return None

    # -- where a key is found ---------------------------------------------------------------
    def twin(self, key: str) -> str:
        return self.root + key

    def locate(self, key: str) -> str | None:
        """The path that holds ``key``'s view (its twin, or a real path), or None when the
        script removed it. The path may not exist (a key that is nowhere)."""
        if self.touched and key not in self.containers and (
                self.shared or _parent(key) in self.twin_dirs):
            twin = self.root + key
            if _lstat(twin) is not None:
                return twin
        return self.under(key)

    def under(self, key: str) -> str | None:
        """What the real disk shows at ``key`` through the script's whiteouts and renames."""
        if not (self.hidden or self.origin):
            return key
        k = key
        while True:
            source = self.origin.get(k)
            if source is not None:
                return source + key[len(k):]
            if k in self.hidden:
                return None
            if k == "/":
                return key
            k = _parent(k)

    def lstat(self, key: str, follow: bool = False) -> os.stat_result | None:
        where = self.locate(key)
        if where is None:
            return None
        try:
            return posix.stat(where, follow_symlinks=follow)
        except OSError:
            return None

    def exists(self, key: str) -> bool:
        return self.lstat(key) is not None

    def is_dir(self, key: str) -> bool:
        s = self.lstat(key, follow=True)
        return s is not None and stat.S_ISDIR(s.st_mode)

    def require_dir(self, key: str, path: Any) -> None:
        """OSError (as the kernel gives for ``path``) unless ``key`` is a directory."""
        s = self.lstat(key, follow=True)
        if s is None:
            raise path_error(errno.ENOENT, path)
        if not stat.S_ISDIR(s.st_mode):
            raise path_error(errno.ENOTDIR, path)

    def names(self, key: str) -> list[str]:
        """The entries of the view's directory ``key``: its twin's, the real ones the script
        did not remove, and what it renamed into it."""
        out: dict[str, None] = {}
        twin = self.root + key
        if self.touched and _is_dir(twin):
            out.update(dict.fromkeys(posix.listdir(twin)))
        real = self.under(key)
        if real is not None and _is_dir(real):
            for name in posix.listdir(real):
                child = _child(key, name)
                if child not in self.hidden or child in self.origin:
                    out.setdefault(name)
        for k in self.origin:
            if k != "/" and _parent(k) == key:
                out.setdefault(posixpath.basename(k))
        return list(out)

    # -- changes ----------------------------------------------------------------------------
    def make_container(self, key: str) -> None:
        """Make sure the view's directory ``key`` has a twin directory to hold new twins."""
        twin = self.root + key
        if key in self.containers or _lstat(twin) is not None:
            return
        self.make_container(_parent(key))
        _mkdir(twin)
        self.containers.add(key)
        self.twin_dirs.add(key)
        self.touched = True

    def create(self, key: str, make: Any) -> None:
        """``make(twin)`` makes the new entry ``key`` (its parent a directory of the view)."""
        self.make_container(_parent(key))
        make(self.root + key)
        self.touched = True
        s = _lstat(self.root + key)
        if s is not None and stat.S_ISDIR(s.st_mode):
            self.twin_dirs.add(key)

    def materialize(self, key: str) -> str:
        """The twin of the existing ``key``, holding what the view shows there (a real file
        copied, a real directory's mode and times; its entries stay where they are)."""
        twin = self.root + key
        where = self.locate(key)
        if where == twin:
            return twin
        s = posix.lstat(where)
        self.make_container(_parent(key))
        if stat.S_ISDIR(s.st_mode):
            if key in self.containers:
                self.containers.discard(key)
            else:
                _mkdir(twin)
                self.twin_dirs.add(key)
            posix.chmod(twin, stat.S_IMODE(s.st_mode))
            posix.utime(twin, ns=(s.st_atime_ns, s.st_mtime_ns))
        elif stat.S_ISLNK(s.st_mode):
            posix.symlink(posix.readlink(where), twin)
        elif stat.S_ISREG(s.st_mode):
            _copy_file(where, twin, s)
        else:  # a fifo, a socket, a device: nothing to copy
            raise path_error(errno.EPERM, key)
        self.touched = True
        return twin

    def for_write(self, key: str, keep: bool) -> str:
        """The twin to write ``key`` through (its parent checked to be a directory): the
        current contents copied when ``keep``, else an empty file of the same mode."""
        twin = self.root + key
        where = self.locate(key)
        if where == twin:
            return twin
        s = None if where is None else _lstat(where)
        if s is not None and keep:
            return self.materialize(key)
        self.make_container(_parent(key))
        if s is not None:
            fd = posix.open(twin, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                posix.fchmod(fd, stat.S_IMODE(s.st_mode))
            finally:
                posix.close(fd)
        self.touched = True
        return twin

    def remove(self, key: str) -> None:
        """Take ``key`` and all below it out of the view."""
        twin = self.root + key
        s = _lstat(twin)
        if s is not None:
            if stat.S_ISDIR(s.st_mode):
                remove_tree(twin)
            else:
                posix.unlink(twin)
        below = _below(key)
        self.containers = {c for c in self.containers if c != key and not c.startswith(below)}
        self.twin_dirs = {d for d in self.twin_dirs if d != key and not d.startswith(below)}
        for k in [k for k in self.origin if k == key or k.startswith(below)]:
            del self.origin[k]
        self.hidden = {h for h in self.hidden if not h.startswith(below)}
        self.hidden.add(key)

    def move(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst`` in the view (``dst`` free, its parent a directory):
        twins move, real contents are shown at ``dst`` through an origin, not copied."""
        real = self.under(src)
        if real is not None and _lstat(real) is None:
            real = None
        twin = self.root + src
        if _lstat(twin) is not None:
            self.make_container(_parent(dst))
            posix.rename(twin, self.root + dst)
        self._carry_marks(src, dst)
        if real is not None:
            self.origin[dst] = real
        self.hidden.add(dst)
        self.hidden.add(src)

    def _carry_marks(self, src: str, dst: str) -> None:
        """The whiteouts, origins and containers at and below ``src``, moved to ``dst``."""
        below = _below(src)

        def moved(k: str) -> str:
            return dst + k[len(src):]
        for marks in (self.containers, self.twin_dirs):
            for k in [k for k in marks if k == src or k.startswith(below)]:
                marks.discard(k)
                marks.add(moved(k))
        for k in [k for k in self.origin if k == src or k.startswith(below)]:
            self.origin[moved(k)] = self.origin.pop(k)
        for k in [k for k in self.hidden if k.startswith(below)]:
            self.hidden.discard(k)
            self.hidden.add(moved(k))


def _copy_file(src: str, dst: str, s: os.stat_result) -> None:
    """Copy a regular file with the real functions: contents, mode and times."""
    with _io.open(src, "rb") as fin, _io.open(dst, "xb") as fout:
        while True:
            chunk = fin.read(1 << 20)
            if not chunk:
                break
            fout.write(chunk)
    posix.chmod(dst, stat.S_IMODE(s.st_mode))
    posix.utime(dst, ns=(s.st_atime_ns, s.st_mtime_ns))


def remove_tree(path: str) -> None:
    """``rm -rf`` of a path in the scratch directory, with the real functions (directories
    the script made read-only are made writable first)."""
    s = _lstat(path)
    if s is None:
        return
    if not stat.S_ISDIR(s.st_mode):
        posix.unlink(path)
        return
    try:
        posix.chmod(path, 0o700)
    except OSError:
        pass
    for name in posix.listdir(path):
        remove_tree(f"{path}/{name}")
    posix.rmdir(path)
