"""The module paths from before the sub-packages still import, as the same modules, with a
DeprecationWarning naming the new place."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from memmagic._moved import MOVED, new_name


def test_every_old_path_names_an_existing_module_and_is_gone_from_disk():
    import memmagic

    root = __import__("pathlib").Path(memmagic.__file__).parent
    for old, new in MOVED.items():
        importlib.import_module(new)
        rel = old.split(".", 1)[1]
        assert not (root / f"{rel}.py").exists() and not (root / rel).exists(), old


@pytest.mark.parametrize("old", ["memmagic.cell", "memmagic.sweep", "memmagic.tracking",
                                 "memmagic.scratchdisk", "memmagic.scratchdisk.view"])
def test_an_old_path_gives_the_same_module_with_a_warning(old):
    code = (f"import warnings, importlib\nwarnings.simplefilter('error', DeprecationWarning)\n"
            f"import memmagic\n"
            f"try:\n    import {old}\nexcept DeprecationWarning as w:\n    print(w)\n"
            f"warnings.simplefilter('ignore')\nimport {old} as mod\n"
            f"print(mod is importlib.import_module({new_name(old)!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    warning, same = out.stdout.strip().splitlines()
    first = next(m for m in MOVED if old == m or old.startswith(m + "."))  # its package warns first
    assert warning == f"{first} is now {MOVED[first]}: import it from there"
    assert same == "True"


def test_names_from_an_old_path_are_the_new_ones():
    with pytest.warns(DeprecationWarning):
        sys.modules.pop("memmagic.knobs", None)
        from memmagic.knobs import KNOBS
    from memmagic.whatif.knobs import KNOBS as now

    assert KNOBS is now


def test_new_name_maps_a_moved_package_and_its_modules_only():
    assert new_name("memmagic.scratchdisk.disk") == "memmagic.frontends.scratchdisk.disk"
    assert new_name("memmagic.cell") == "memmagic.whatif.engine"
    assert new_name("memmagic.report") is None and new_name("memmagic") is None
    assert new_name("memmagic.cells") is None and new_name("torch.cell") is None
