"""What a script changed on its view of the disk, net of what it undid itself (a temporary
file it made and removed is no change), for the report's note."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

__all__ = ["Changes", "ChangeSummary"]


def _at_or_below(path: str, key: str) -> bool:
    return path == key or path.startswith(key.rstrip("/") + "/")


class Changes:
    """The log a :class:`~memmagic.frontends.scratchdisk.ScratchDisk` keeps while a script runs:
    keys are absolute paths of the script's view; what it removed or renamed is told by
    the real path it was (a file in a renamed folder is found where the folder was)."""

    def __init__(self) -> None:
        self.created: dict[str, tuple[str, bool]] = {}  # key -> ("file" | "dir", existed)
        self.removed: dict[str, None] = {}  # real paths
        self.moved: dict[str, str] = {}  # key -> the real path renamed to it
        self.altered: dict[str, None] = {}
        self.refused: list[str] = []

    def origin(self, key: str) -> str:
        """The real path ``key`` stands for (itself unless it, or a folder above it, is
        something the script renamed)."""
        k = key
        while k not in self.moved:
            if k == os.path.dirname(k):
                return key
            k = os.path.dirname(k)
        return self.moved[k] + key[len(k):]

    def wrote(self, key: str, existed: bool, kind: str = "file") -> None:
        self.created.setdefault(key, (kind, existed))

    def deleted(self, key: str) -> None:
        own = self.created.get(key)
        real = self.origin(key)
        for log in (self.created, self.altered):
            for k in [k for k in log if _at_or_below(k, key)]:
                del log[k]
        for k in [k for k in self.moved if _at_or_below(k, key)]:
            self.removed.setdefault(self.moved.pop(k))
        if own is None or own[1]:  # not a path the script made itself
            self.removed.setdefault(real)

    def renamed(self, src: str, dst: str) -> None:
        own = src in self.created
        real = self.origin(src)

        def rekey(log: dict) -> None:
            for k in [k for k in log if _at_or_below(k, src)]:
                log[dst + k[len(src):]] = log.pop(k)
        rekey(self.created)
        rekey(self.altered)
        self.moved.pop(src, None)
        rekey(self.moved)
        if not own and real != dst:
            self.moved[dst] = real

    def changed(self, key: str) -> None:
        if key not in self.created:
            self.altered.setdefault(key)

    def summary(self) -> ChangeSummary:
        removed = [k for k in self.removed
                   if not any(_at_or_below(k, other) and k != other for other in self.removed)]
        return ChangeSummary(
            wrote=tuple(k for k, (kind, _) in self.created.items() if kind == "file"),
            made=tuple(k for k, (kind, _) in self.created.items() if kind == "dir"),
            deleted=tuple(removed),
            renamed=tuple((src, dst) for dst, src in self.moved.items()),
            changed=tuple(self.altered),
            refused=tuple(self.refused))


@dataclass(frozen=True)
class ChangeSummary:
    """The net changes of one or more runs of a script, none of which reached the disk."""

    wrote: tuple[str, ...] = ()
    made: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()
    renamed: tuple[tuple[str, str], ...] = ()
    changed: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()

    def __or__(self, other: ChangeSummary) -> ChangeSummary:
        def union(a: Iterable, b: Iterable) -> tuple:
            return tuple(dict.fromkeys([*a, *b]))
        return ChangeSummary(*(union(getattr(self, f), getattr(other, f))
                               for f in ("wrote", "made", "deleted", "renamed", "changed",
                                         "refused")))

    def __bool__(self) -> bool:
        return bool(self.wrote or self.made or self.deleted or self.renamed or self.changed)

    def note(self, here: str | None = None) -> str:
        """One line: what the script changed, and that the disk kept none of it ('' when it
        changed nothing). Paths below ``here`` (default: the working directory) relative."""
        here = os.getcwd() if here is None else here

        def rel(path: str) -> str:
            return os.path.relpath(path, here) if _at_or_below(path, here) else path

        def show(items: Iterable[str]) -> str:
            shown = list(items)
            more = f" and {len(shown) - 5} more" if len(shown) > 5 else ""
            return ", ".join(shown[:5]) + more
        parts = [f"{verb} {show(map(rel, paths))}" for verb, paths in (
            ("wrote", self.wrote), ("made", self.made), ("deleted", self.deleted),
            ("changed the mode, owner or times of", self.changed)) if paths]
        if self.renamed:
            parts.append("renamed " + show(f"{rel(a)} to {rel(b)}" for a, b in self.renamed))
        if not parts:
            return ""
        return (f"the script {'; '.join(parts)}: in a scratch copy of the disk, removed after "
                "the run (nothing on disk was changed)")
