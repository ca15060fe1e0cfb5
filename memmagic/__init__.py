"""memmagic: see what a PyTorch cell does to GPU memory, right in the notebook.

In IPython/Jupyter::

    %load_ext memmagic

    %%gpumem
    ...your cell...

In scripts: :func:`measure` and :func:`track` return the same :class:`MemoryReport`.
"""

from __future__ import annotations

from .report import Category, MemoryReport, format_bytes, parse_bytes

__all__ = [
    "Category", "MemoryReport", "format_bytes", "parse_bytes", "measure", "track",
    "load_ipython_extension", "unload_ipython_extension", "__version__",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # torch is imported only when measuring is asked for: reading a report needs no torch.
    if name in ("measure", "track"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'memmagic' has no attribute {name!r}")


def load_ipython_extension(ipython) -> None:
    """``%load_ext memmagic``: register ``%%gpumem`` and ``%gpumem``."""
    from .magics import MemMagics

    ipython.register_magics(MemMagics)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext memmagic``: remove the magics again."""
    mm = ipython.magics_manager
    for kind in ("line", "cell"):
        mm.magics[kind].pop("gpumem", None)
    mm.registry.pop("MemMagics", None)
