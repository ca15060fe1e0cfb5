"""Programs a script starts run outside its view of the disk (and outside the simulated
GPU): none is started. To the script the program is not installed (a ProgramRefused,
which is a FileNotFoundError; ``os.system`` answers the shell's 127, "command not found"),
as libraries that probe for ``nvidia-smi`` or ``git`` expect on a machine without one;
the report lists what was refused. ``os.fork`` (multiprocessing's default
on Linux, a DataLoader's workers) is not refused: a forked process keeps the scratch disk.
Processes started fresh (multiprocessing's ``spawn`` and ``forkserver``, which
``torch.multiprocessing.spawn`` uses by default) are refused, with what to use instead."""

from __future__ import annotations

import os
import subprocess
from typing import Any, Callable

from ...core.patching import Patches
from .errors import ProgramRefused
from .installed import current, replace_once

__all__ = ["install"]

_OUTSIDE = "runs outside memmagic run's scratch disk and simulated GPU"
_SPAWN_HINT = ("start them with the 'fork' method (multiprocessing.get_context('fork'), "
               "torch.multiprocessing.start_processes(fn, args, nprocs, "
               "start_method='fork')), or run one process")


def _shown(args: Any) -> str:
    if isinstance(args, (str, bytes, os.PathLike)):
        return os.fsdecode(args)
    try:
        return " ".join(os.fsdecode(a) for a in args)
    except TypeError:
        return repr(args)


def _refuse_program(program: str, what: str) -> None:
    current().refuse(f"started the program {program!r} ({what})", _OUTSIDE,
                     error=ProgramRefused)


def _refusing(original: Any, what: str, program_at: int) -> Callable:
    """A replacement of ``original`` that starts no program during a run; the program it
    would start is its argument number ``program_at``."""
    def refused(*args: Any, **kwargs: Any) -> Any:
        if current().active:
            _refuse_program(_shown(args[program_at]) if len(args) > program_at else "...", what)
        return original(*args, **kwargs)
    return refused


def _system(original: Any) -> Callable:
    def system(command: Any) -> int:
        if not current().active:
            return original(command)
        try:
            _refuse_program(_shown(command), "os.system")
        except ProgramRefused:
            pass
        return 127 << 8  # the shell's exit status for a command not found
    return system


def _execute_child(original: Any) -> Callable:
    def execute_child(self: Any, args: Any, *more: Any) -> Any:
        if current().active:
            _refuse_program(_shown(args), "subprocess")
        return original(self, args, *more)
    return execute_child


def _spawnv_passfds(original: Any) -> Callable:
    def spawnv_passfds(path: Any, args: Any, passfds: Any) -> Any:
        if current().active:
            current().refuse(
                "started a process with multiprocessing's 'spawn' or 'forkserver' start "
                "method (torch.multiprocessing.spawn's default)",
                "runs a fresh Python outside memmagic run's scratch disk and simulated GPU",
                _SPAWN_HINT)
        return original(path, args, passfds)
    return spawnv_passfds


def install(patches: Patches) -> None:
    """Start no program while the disk installed now is active."""
    import multiprocessing.util

    replace_once(patches, os, "system", _system)
    for name in ("posix_spawn", "posix_spawnp", "execv", "execve", "spawnv", "spawnve",
                 "spawnvp", "spawnvpe"):
        if hasattr(os, name):
            at = 1 if name.startswith("spawn") else 0
            replace_once(patches, os, name,
                     lambda original, name=name, at=at: _refusing(original, f"os.{name}", at))
    replace_once(patches, subprocess.Popen, "_execute_child", _execute_child)
    replace_once(patches, multiprocessing.util, "spawnv_passfds", _spawnv_passfds)
