"""A scratch disk for a script run by ``python -m memmagic run``: the script sees the real
disk with its own changes over it, and the real disk is never changed.

What the script writes (``open`` for writing or appending, ``os.open``, ``io.FileIO``,
``torch.save``, safetensors, ``np.save``), makes (``os.mkdir``, ``os.makedirs``, links,
fifos), removes (``os.remove``, ``os.rmdir``, ``shutil.rmtree``), renames
(``os.rename``, ``os.replace``, ``shutil.move``) or changes (``os.chmod``, ``os.chown``,
``os.utime``, ``os.truncate``, extended attributes) lands in a scratch directory, removed
after the run; a real file it appends to or changes is copied there first. Its reads,
``os.stat`` and directory listings (``os.listdir``, ``os.scandir``, and so ``os.walk``,
``glob`` and ``pathlib``) see the result: what it wrote, it reads back; what it removed is
gone for it. ``tempfile`` and ``shutil``'s copies follow, through the ``os`` functions.
Imports write no ``__pycache__`` during the run.

What cannot be kept off the disk is refused before it changes anything
(:class:`RefusedCall`, which ends the run): multiprocessing's ``spawn`` start method,
``os.chroot``, a change through a directory descriptor (``dir_fd=``) or through a
descriptor of a real file the script opened for reading. Programs (``subprocess``,
``os.system``, ``os.exec*``) are not started: to the script they are not installed
(:class:`ProgramRefused`, a FileNotFoundError), as libraries probing for ``nvidia-smi``
expect on a machine without one.

Known limitations:

* Code in C, C++ or Rust that opens files itself is covered only where named in
  :mod:`.libraries` (torch, safetensors, numpy, sqlite3); others (h5py, pyarrow's
  writers, a custom extension) would write to the disk.
* A function a module bound by name before the first run (``from os import remove``) is
  the real one; those found in the standard library, numpy and torch are covered
  (tarfile's and bz2's ``open``, numpy's ``savetxt``). A module that bound
  ``safetensors.safe_open`` so reads the real file, not what the script wrote.
* ``numpy.memmap`` in mode ``r+`` over a real file is mapped copy-on-write: a second map
  of the file does not see the first one's writes.
* ``os.fwalk`` and reads through ``dir_fd=`` see the real directories only.
* A forked process (multiprocessing's ``fork``, DataLoader workers) writes to the same
  scratch directory, which the script sees; what it removes or renames is gone only for
  itself, and the report's note does not list its changes.
* POSIX only (Linux, macOS).
"""

from __future__ import annotations

from .changes import ChangeSummary
from .disk import ScratchDisk
from .errors import ProgramRefused, RefusedCall

__all__ = ["ScratchDisk", "RefusedCall", "ProgramRefused", "ChangeSummary"]
