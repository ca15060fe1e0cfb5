"""A simulated GPU that lasts the whole notebook.

A :class:`SimSession` holds one :class:`Card`: the fake-tensor mode, the simulation state,
the tracker (whose live storages *are* the card's memory) and the caching-allocator
model, plus the *shadow*: for each notebook name, the simulated object a later simulated
cell gets under that name. A cell's tensors that are still referenced after it stay on
the card, so the next cell's ``before``, ``torch.cuda.memory_allocated()`` and the
allocator's reserved memory carry over, as on a GPU; a tensor dropped between cells frees
its block then. ``reset()`` empties the card.

What the notebook (and a real cell) sees after a simulated cell:

* a name the cell made or rebound to something that holds simulated tensors: a
  :class:`~memmagic.backends.sim.sandbox.SimulatedValue` that says, in one line, that the
  object lives on the simulated GPU; later simulated cells get the object itself;
* a name bound to a value without simulated tensors (a config, a list of ints, a string,
  a shape): that value, for real;
* a name that held a real object from a real cell and was only used (even mutated) by the
  simulated cell: the real object, bit-identical; later simulated cells get the simulated
  copy, with everything the simulated cells did to it (moved to the GPU, trained).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ... import _torch_private as _priv
from .allocator import AllocatorFull, CachingAllocatorModel
from .device import SimState, SimTracker
from .errors import SimulationUnsupported
from .gpus import GPUSpec
from .op_cache import FakeOutputCache
from .workspaces import Workspaces

__all__ = ["SimSession", "Card", "Shadow", "shell_session"]


@dataclass
class Shadow:
    """``shown``: the object the notebook's namespace holds under the name; ``value``: the
    simulated object a simulated cell gets instead."""

    shown: Any
    value: Any


class Card:
    """The simulated GPU itself (see the module docstring)."""

    def __init__(self, kernels: str, target: GPUSpec | None, capability: tuple[int, int],
                 max_ops: int, max_seconds: float, entries: dict | None) -> None:
        cuda = kernels == "cuda"
        self.kernels = kernels
        self.target = target
        self.capability = capability
        self.state = SimState(cuda)
        allocator = CachingAllocatorModel(target.total_memory if target else None) if cuda else None
        self.tracker = SimTracker(self.state, allocator=allocator, max_ops=max_ops,
                                  max_seconds=max_seconds)
        if cuda:
            self.tracker.workspaces = Workspaces(capability)
        self.fake_mode = _priv.new_fake_mode()
        self._entries = entries
        self.fast = None
        self.shadow: dict[str, Shadow] = {}
        self.cells = 0  # simulated cells run on this card

    def op_cache(self, on: bool):
        """The card's FakeOutputCache (made on first use), or None when ``on`` is False."""
        if not on:
            return None
        if self.fast is None:
            self.fast = FakeOutputCache(self.fake_mode, self._entries if self._entries is not None else {})
        return self.fast

    def retarget(self, target: GPUSpec | None) -> str | None:
        """Put the card's live blocks into a model of another card; a note, or None."""
        if target == self.target:
            return None
        old, self.target = self.target, target
        tr = self.tracker
        if tr.allocator is None:
            return None
        new = CachingAllocatorModel(target.total_memory if target else None)
        try:
            for serial in sorted(tr._alloc_bytes):
                new.malloc(serial, tr._alloc_bytes[serial])
        except AllocatorFull:
            self.target = old
            raise SimulationUnsupported(
                f"the simulated GPU holds {tr.current['device']:,} B from earlier cells, more than "
                f"{target.name if target else 'the new card'} can take: run %gpusim reset "
                "(or memmagic.reset_simulated_gpu()) first") from None
        tr.allocator = new
        if tr.workspaces is not None and target is not None:
            fresh = Workspaces(target.capability)  # sizes for workspaces taken from now on
            tr.workspaces.cublas, tr.workspaces.cublaslt = fresh.cublas, fresh.cublaslt
        tr.cuda_reserved_peak = new.reserved
        was = old.name if old else "no target"
        now = target.name if target else "no target"
        return f"the simulated card changed from {was} to {now}: its tensors moved with it"

    def live_bytes(self) -> int:
        return self.tracker.current["device"]

    def reserved_bytes(self) -> int:
        a = self.tracker.allocator
        return a.reserved if a is not None else self.tracker.current["device"]


class SimSession:
    """The simulated GPU of one notebook (one IPython shell): see the module docstring."""

    def __init__(self) -> None:
        self.card: Card | None = None
        self.resets = 0

    def card_for(self, kernels: str, target: GPUSpec | None, capability: tuple[int, int],
                 max_ops: int, max_seconds: float, entries: dict | None) -> tuple[Card, list[str]]:
        """The card for a cell with these options (made on first use), and notes."""
        notes: list[str] = []
        card = self.card
        if card is not None and card.kernels != kernels:
            self.reset()
            notes.append(f"kernels={kernels!r}: a new simulated GPU (the one with "
                         f"kernels={card.kernels!r} was emptied)")
            card = None
        if card is None:
            card = self.card = Card(kernels, target, capability, max_ops, max_seconds, entries)
            card.tracker.persistent = True
        else:
            note = card.retarget(target)
            if note:
                notes.append(note)
        return card, notes

    def reset(self) -> int:
        """Empty the simulated GPU; returns the bytes it held. Names that held its objects
        say so when used."""
        card, self.card = self.card, None
        if card is None:
            return 0
        held = card.live_bytes()
        from .sandbox import SimulatedValue

        for sh in card.shadow.values():
            if isinstance(sh.shown, SimulatedValue):
                sh.shown._forget()
        card.shadow.clear()
        card.tracker.persistent = False
        card.tracker.close()
        self.resets += 1
        return held

    def status(self) -> str:
        card = self.card
        if card is None:
            return "simulated GPU: empty (no simulated cell has run since the last reset)"
        from ...report import format_bytes

        name = card.target.name if card.target else "no target card"
        names = ", ".join(sorted(card.shadow)) or "none"
        return (f"simulated GPU ({name}): {format_bytes(card.live_bytes())} allocated, "
                f"{format_bytes(card.reserved_bytes())} reserved; names holding simulated "
                f"objects: {names}")


def shell_session(shell: Any) -> SimSession:
    """The SimSession of an IPython shell (made on first use)."""
    session = getattr(shell, "_memmagic_sim_session", None)
    if session is None:
        session = SimSession()
        try:
            setattr(shell, "_memmagic_sim_session", session)
        except Exception:  # a shell that takes no attributes: a session per call
            pass
    return session
