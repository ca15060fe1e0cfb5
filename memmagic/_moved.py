"""The module paths from before the package took its folders: ``import memmagic.cell``
gives ``memmagic.whatif.engine`` (the same module object) with a DeprecationWarning that
names the new place, so scripts and notebooks written against the old paths keep running.

One finder on ``sys.meta_path``, installed when memmagic is imported, answering only for
the names in :data:`MOVED`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "memmagic._torch_private": "memmagic.core._torch_private",
    "memmagic.patching": "memmagic.core.patching",
    "memmagic.interrupts": "memmagic.core.interrupts",
    "memmagic.failures": "memmagic.core.failures",
    "memmagic.tracking": "memmagic.core.tracking",
    "memmagic.objgraph": "memmagic.core.objgraph",
    "memmagic.snapshot": "memmagic.core.snapshot",
    "memmagic.plots": "memmagic.charts.plots",
    "memmagic.svgcharts": "memmagic.charts.svg",
    "memmagic.cell": "memmagic.whatif.engine",
    "memmagic.knobs": "memmagic.whatif.knobs",
    "memmagic.sweep": "memmagic.whatif.sweeps",
    "memmagic.sharding": "memmagic.whatif.sharding",
    "memmagic.magics": "memmagic.frontends.magics",
    "memmagic.options": "memmagic.frontends.options",
    "memmagic.simmode": "memmagic.frontends.simmode",
    "memmagic.widgets": "memmagic.frontends.widgets",
    "memmagic.cli": "memmagic.frontends.cli",
    "memmagic.scriptrun": "memmagic.frontends.scriptrun",
    "memmagic.scratchdisk": "memmagic.frontends.scratchdisk",
    "memmagic.budget": "memmagic.frontends.budget",
    "memmagic.pytest_plugin": "memmagic.frontends.pytest_plugin",
}


def new_name(name: str) -> str | None:
    """Where the module once called ``name`` lives now (a moved package's modules too);
    None for a name that did not move."""
    head, _, rest = name.partition(".")
    while True:
        if head in MOVED:
            return MOVED[head] + (f".{rest}" if rest else "")
        if not rest:
            return None
        part, _, rest = rest.partition(".")
        head = f"{head}.{part}"


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a moved module's old name; loading it puts the new module in its place."""

    def find_spec(self, name, path=None, target=None):
        if new_name(name) is None:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return None  # a placeholder that exec_module replaces

    def exec_module(self, module) -> None:
        new = new_name(module.__name__)
        warnings.warn(f"{module.__name__} is now {new}: import it from there",
                      DeprecationWarning, stacklevel=2)
        # importlib hands out what sys.modules holds after this call: the module itself
        sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())  # before the path finder, which would load
        # a moved package's modules a second time under their old names
