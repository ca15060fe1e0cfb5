"""Which scratch disk is installed now: every replacement function asks here, so that one a
module bound by name during an earlier run (``from os import remove``, tarfile's
``bltn_open``, safetensors' ``serialize_file``) acts for the run of now, and calls what it
replaced outside a run."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["INSTALLED", "current", "replace_once"]


class _NoDisk:
    active = False


class _Installed:
    disk: Any = _NoDisk()


INSTALLED = _Installed()


def current() -> Any:
    """The disk installed now (its ``active`` is False outside a run)."""
    return INSTALLED.disk


_MADE: dict[int, tuple[Any, Callable]] = {}  # id(original) -> (original, its replacement)


def replace_once(patches: Any, owner: Any, name: str, make: Callable[[Any], Callable]) -> None:
    """``owner.name`` replaced (through ``patches``) by ``make(original)``, made once per
    original: a module that bound it by name during one run reaches the disk of the next
    through it, and one found there already is left as it is."""
    value = getattr(owner, name)
    if getattr(value, "__scratchdisk__", False):
        return
    made = _MADE.get(id(value))
    if made is None or made[0] is not value:
        replacement = make(value)
        replacement.__scratchdisk__ = True
        replacement.__wrapped__ = value
        made = _MADE[id(value)] = (value, replacement)
    patches.set(owner, name, made[1])
