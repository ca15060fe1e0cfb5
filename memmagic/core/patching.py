"""The one undo log for global state: temporary attribute patches, entered context
managers and undo callbacks, all undone in reverse order by :meth:`Patches.restore` (also
after an exception). Every install of global state in memmagic (the simulation's patches,
the what-if knobs' hooks) goes through one of these."""

from __future__ import annotations

import io
import sys
from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["Patches", "output_captured"]

_MISSING = object()


class Patches:
    """``set(obj, name, value)`` remembers the old value; ``restore()`` puts every one back."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        d = getattr(obj, "__dict__", None)
        # an inherited attribute (not in the object's own dict) is deleted again on restore
        old = d.get(name, _MISSING) if d is not None else getattr(obj, name, _MISSING)
        self._undo.append((obj, name, old))
        setattr(obj, name, value)

    def original(self, obj: Any, name: str) -> Any:
        """What ``obj.name`` was before this log first set it (its value now if never set)."""
        for o, n, old in self._undo:
            if o is obj and n == name:
                return getattr(type(obj), name, None) if old is _MISSING else old
        return getattr(obj, name)

    def set_item(self, mapping: Any, key: Any, value: Any) -> None:
        """``mapping[key] = value`` (``os.environ`` included), put back or deleted again on
        restore."""
        old = mapping.get(key, _MISSING)
        mapping[key] = value
        self.call_on_restore(lambda: mapping.__setitem__(key, old) if old is not _MISSING
                             else mapping.pop(key, None))

    def call_on_restore(self, callback: Any) -> None:
        """Call ``callback()`` when :meth:`restore` reaches this point (undoing a change that
        is not an attribute: a cache filled while patched)."""
        self._undo.append((None, "", callback))

    def enter(self, cm: Any) -> Any:
        """Enter the context manager ``cm`` now; :meth:`restore` exits it at this point."""
        value = cm.__enter__()
        self.call_on_restore(lambda: cm.__exit__(None, None, None))
        return value

    def restore(self) -> None:
        errors = []
        while self._undo:
            obj, name, old = self._undo.pop()
            try:
                if obj is None and not name:
                    old()
                elif old is _MISSING:
                    delattr(obj, name)
                else:
                    setattr(obj, name, old)
            except BaseException as exc:  # noqa: BLE001 - keep restoring the rest
                errors.append(exc)
        if errors:
            raise errors[0]

    def __len__(self) -> int:
        return len(self._undo)


@contextmanager
def output_captured() -> Iterator[io.StringIO]:
    """While active, what code prints to ``sys.stdout`` and ``sys.stderr`` (``print``,
    warnings) goes to the buffer yielded, not to the user: the output of a re-run that
    answers a what-if or the doctor, which the user did not run. (A logging handler made
    earlier keeps the stream it was given.)"""
    buffer = io.StringIO()
    patches = Patches()
    try:
        patches.set(sys, "stdout", buffer)
        patches.set(sys, "stderr", buffer)
        yield buffer
    finally:
        patches.restore()
