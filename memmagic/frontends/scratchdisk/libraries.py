"""Libraries that open files past Python's ``open`` (in C, C++ or Rust), sent through the
scratch disk while a script runs:

* ``torch.save`` to a path: its C++ zip writer is handed the twin (``torch.load`` reads
  through ``open``, and its ``mmap=True`` through ``UntypedStorage.from_file``, below);
* ``torch.jit.save`` / ``torch.jit.load``, ``torch.from_file`` and
  ``torch.UntypedStorage.from_file`` (``shared=True`` writes the file);
* safetensors' ``serialize_file`` (``save_file``, ``save_model``) and ``safe_open``
  (``load_file``), in every safetensors module loaded (safetensors is imported first when
  it is installed, so that modules the script imports bind the replacements);
* ``numpy.memmap`` in its default mode ``r+`` over a real file maps it copy-on-write (mode
  ``c``: the script's writes stay in memory) instead of copying the file to the scratch
  directory first; ``np.save``, ``np.load`` and other memmap modes go through ``open``,
  ``np.savetxt`` and ``np.loadtxt`` through the ``open`` numpy bound at its import;
* ``sqlite3.connect`` to a file opens its twin (the journal is made beside it).

Outside a run each replacement calls what it replaced.
"""

from __future__ import annotations

import importlib.util
import io
import os
import sys
from typing import Any, Callable

import _io

from ...core import _torch_private as _priv
from ...core.patching import Patches
from .installed import current, replace_once

__all__ = ["install"]


def _is_path(f: Any) -> bool:
    return isinstance(f, (str, bytes, os.PathLike))


def _to_write(f: Any) -> Any:
    """The twin a library writes the path ``f`` through (``f`` itself outside a run)."""
    disk = current()
    return disk.writable(f, keep=False) if disk.active and _is_path(f) else f


def _to_read(f: Any) -> Any:
    disk = current()
    return disk.readable(f) if disk.active and _is_path(f) else f


def _path_at(at: int, through: Callable[[Any], Any]) -> Callable[[Any], Callable]:
    """``make`` for a function whose argument number ``at`` is a path, sent ``through``."""
    def make(original: Any) -> Callable:
        def replacement(*args: Any, **kwargs: Any) -> Any:
            if len(args) > at:
                args = (*args[:at], through(args[at]), *args[at + 1:])
            return original(*args, **kwargs)
        return replacement
    return make


def _from_file(original: Any) -> Callable:
    """``from_file(filename, shared, size, ...)``: with ``shared`` the mapping writes the
    file (made when missing), so the twin is mapped."""
    def from_file(filename: Any, shared: Any = None, *args: Any, **kwargs: Any) -> Any:
        disk = current()
        if disk.active and _is_path(filename):
            filename = (disk.writable(filename, keep=True) if shared
                        else disk.readable(filename))
        return original(filename, shared, *args, **kwargs)
    return from_file


def _torch(patches: Patches) -> None:
    import torch
    import torch.jit

    module, name = _priv.zipfile_writer_slot()
    replace_once(patches, module, name, _path_at(0, _to_write))
    replace_once(patches, torch.jit, "save", _path_at(1, _to_write))
    replace_once(patches, torch.jit, "load", _path_at(0, _to_read))
    replace_once(patches, torch, "from_file", _from_file)
    storage_from_file = _from_file(torch.UntypedStorage.from_file)
    patches.set(torch.UntypedStorage, "from_file",
                classmethod(lambda cls, *args, **kwargs: storage_from_file(*args, **kwargs)))


def _safetensors(patches: Patches) -> None:
    if "safetensors" not in sys.modules and importlib.util.find_spec("safetensors") is None:
        return
    import safetensors  # noqa: F401 - loaded so that later imports bind the replacements

    for name, module in list(sys.modules.items()):
        if name == "safetensors" or name.startswith("safetensors."):
            for attr, make in (("serialize_file", _path_at(1, _to_write)),
                               ("safe_open", _path_at(0, _to_read))):
                if hasattr(module, attr):
                    replace_once(patches, module, attr, make)


def _numpy(patches: Patches) -> None:
    np = sys.modules.get("numpy")
    if np is None:
        return
    _numpy_openers(patches)
    new = np.memmap.__new__

    def memmap(subtype: type, filename: Any, dtype: Any = np.uint8, mode: Any = "r+",
               *args: Any, **kwargs: Any) -> Any:
        disk = current()
        if disk.active and mode in ("r+", "readwrite") and _is_path(filename):
            where = disk.readable(filename)
            if where is filename or not str(where).startswith(disk.view.root):
                mode = "c"  # a real file: copy-on-write in memory, the disk left alone
        return new(subtype, filename, dtype, mode, *args, **kwargs)
    patches.set(np.memmap, "__new__", staticmethod(memmap))


def _numpy_openers(patches: Patches) -> None:
    """numpy's ``savetxt``/``loadtxt`` open files through the built-in ``open`` its
    ``_datasource`` module bound when numpy was imported: pointed at the replacement."""
    ds = sys.modules.get("numpy.lib._datasource")
    openers = getattr(getattr(ds, "_file_openers", None), "_file_openers", None)
    if isinstance(openers, dict) and openers.get(None) is _io.open:
        patches.set_item(openers, None, io.open)
    if getattr(ds, "_open", None) is _io.open:
        patches.set(ds, "_open", io.open)


def _connect(original: Any) -> Callable:
    def connect(database: Any, *args: Any, **kwargs: Any) -> Any:
        disk = current()
        if disk.active and _is_path(database) and os.fsdecode(database) != ":memory:":
            if kwargs.get("uri"):
                disk.refuse(f"called sqlite3.connect({database!r}, uri=True)")
            database = disk.writable(database, keep=True)
        return original(database, *args, **kwargs)
    return connect


def _sqlite(patches: Patches) -> None:
    import sqlite3
    import sqlite3.dbapi2

    for module in (sqlite3, sqlite3.dbapi2):
        replace_once(patches, module, "connect", _connect)


def install(patches: Patches) -> None:
    """Send the libraries above through the disk installed now (undone by
    ``patches.restore()``)."""
    _torch(patches)
    _safetensors(patches)
    _numpy(patches)
    _sqlite(patches)
