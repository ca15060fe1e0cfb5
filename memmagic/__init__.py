"""memmagic: see what a PyTorch cell does to GPU memory, right in the notebook.

In IPython/Jupyter::

    %load_ext memmagic

    %%gpumem
    ...your cell...

In scripts: :func:`measure` and :func:`track` return the same :class:`MemoryReport`;
:func:`run_cell` runs a cell's source as the magic does.
"""

from __future__ import annotations

from .report import Category, MemoryReport, format_bytes, parse_bytes
from ._moved import install as _install_moved

_install_moved()  # the module paths of before the sub-packages: see memmagic._moved

__all__ = [
    "Category", "MemoryReport", "format_bytes", "parse_bytes", "measure", "track",
    "run_cell", "CellRequest",
    "Cell", "Setting", "KNOBS", "find_batch_size", "find_seq_len", "fit_map", "WhatIfPanel",
    "check_budget", "BudgetExceeded",
    "load_ipython_extension", "unload_ipython_extension", "__version__",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # torch is imported only when measuring is asked for: reading a report needs no torch.
    if name in ("measure", "track"):
        from . import api

        return getattr(api, name)
    if name in ("run_cell", "CellRequest"):  # the path every front end takes
        from . import pipeline

        return getattr(pipeline, name)
    if name in ("Cell", "Setting", "KNOBS", "find_batch_size", "find_seq_len", "fit_map"):
        from . import whatif

        return getattr(whatif, name)
    if name in ("check_budget", "BudgetExceeded"):  # memory budgets as tests
        from .frontends import budget

        return getattr(budget, name)
    if name == "WhatIfPanel":
        from .frontends.widgets import WhatIfPanel

        return WhatIfPanel
    raise AttributeError(f"module 'memmagic' has no attribute {name!r}")


def load_ipython_extension(ipython) -> None:
    """``%load_ext memmagic``: register ``%%gpumem``, ``%gpumem`` and ``%gpusim`` (a Ctrl-C
    meanwhile waits for the imports to finish)."""
    from .core.interrupts import held

    try:
        with held():
            _load(ipython)
    except (ImportError, AttributeError, KeyError, RuntimeError) as exc:
        from IPython.core.error import UsageError

        raise UsageError(_half_imported(exc)) from None


def _half_imported(exc: BaseException) -> str:
    """The one line for an extension that cannot load because a module it needs is broken,
    most often by a Ctrl-C during its first import (before memmagic was loaded)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return (f"memmagic could not load ({type(exc).__name__}: {first[:160]}): a module it needs "
            "is half-imported, which happens when an import was interrupted (Ctrl-C) earlier "
            "in this kernel and Python cannot undo it: restart the kernel, then run "
            "%load_ext memmagic again")


def _load(ipython) -> None:
    from .frontends.magics import MemMagics
    from .frontends.simmode import sim_mode

    ipython.register_magics(MemMagics)
    _guard_cells(ipython)
    mode = sim_mode(ipython)
    mode.install()

    def gpusim(line: str = "") -> None:
        """%gpusim on [--gpu NAME] [--gpu-memory SIZE] | off | reset: run every following
        cell on the notebook's simulated GPU (one-line footer), stop, or empty that GPU;
        %gpusim alone says where things stand."""
        print(mode.command(line))

    ipython.register_magic_function(gpusim, "line", "gpusim")


def _guard_cells(ipython) -> None:
    """No Ctrl-C lands inside an import or memmagic's bookkeeping in this shell's cells."""
    from .core.interrupts import guard_cells

    stop = ipython.__dict__.pop("_memmagic_stop_guard", None)
    if stop is not None:  # a second %load_ext: one guard
        stop()
    ipython._memmagic_stop_guard = guard_cells(ipython)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext memmagic``: remove the magics and the %gpusim switch again."""
    mm = ipython.magics_manager
    for kind in ("line", "cell"):
        mm.magics[kind].pop("gpumem", None)
    mm.magics["line"].pop("gpusim", None)
    mm.registry.pop("MemMagics", None)
    stop = ipython.__dict__.pop("_memmagic_stop_guard", None)
    if stop is not None:
        stop()
    mode = getattr(ipython, "_memmagic_sim_mode", None)
    if mode is not None:
        mode.unload()  # a new load starts with no card chosen; a %reload_ext resumes the mode
