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
  :class:`~memmagic.backends.sim.values.SimulatedValue` that says, in one line, that the
  object lives on the simulated GPU; later simulated cells get the object itself;
* a name bound to a value without simulated tensors (a config, a list of ints, a string,
  a shape): that value, for real;
* a name that held a real object from a real cell and was only used (even mutated) by the
  simulated cell: the real object, bit-identical; later simulated cells get the simulated
  copy, with everything the simulated cells did to it (moved to the GPU, trained).
"""

from __future__ import annotations

import copy as _copy
import weakref
from typing import Any, Callable, Mapping

import torch

from ...core import _torch_private as _priv
from ...core.interrupts import atomic
from ...report import Category, format_bytes
from .allocator import AllocatorConfig, AllocatorFull, CachingAllocatorModel, alloc_conf_from_env
from .errors import AllocatorConfigError, SimulationUnsupported
from .gpus import CudaContext, CardSpec, cuda_context
from .op_cache import FakeOutputCache, bound_caches
from ...core.patching import Patches
from .frames import release_tracebacks
from .sandbox import Shadow, copy_optimizer, copy_value, reachable_tensors
from .state import SimState
from .tracker import SimTracker
from ...core.tracking import held_by
from .values import SimulatedValue, forget
from .workspaces import Workspaces

__all__ = ["SimSession", "Card", "shell_session", "session_of"]


@atomic
class Card:
    """The simulated GPU itself (see the module docstring).

    ``alloc_config``: the caching allocator's settings; None reads them from the
    environment (``PYTORCH_CUDA_ALLOC_CONF``), as torch does once when CUDA starts: a card
    keeps the settings it was made with (``%gpusim reset`` makes a new card). A value
    torch refuses raises ValueError here."""

    def __init__(self, kernels: str, target: CardSpec | None, capability: tuple[int, int],
                 max_ops: int, max_seconds: float, entries: dict | None,
                 alloc_config: AllocatorConfig | None = None) -> None:
        cuda = kernels == "cuda"
        self.kernels = kernels
        self.target = target
        self.capability = capability
        self.state = SimState(cuda)
        if alloc_config is None and cuda:
            try:
                alloc_config = alloc_conf_from_env()
            except ValueError as exc:
                raise AllocatorConfigError(
                    f"{exc}; torch would refuse it at the first CUDA call: fix or unset the "
                    "variable, then run the cell again") from None
        self.alloc_config = alloc_config
        self.tracker = SimTracker(self.state, allocator=None, max_ops=max_ops,
                                  max_seconds=max_seconds)
        if cuda:
            # the CUDA context a GPU holds beside the allocator, read once as CUDA does
            self._hold_context(cuda_context(target), target)
            self.tracker.allocator = CachingAllocatorModel(
                self.tracker.allowed(target.total_memory) if target else None, alloc_config)
            self.tracker.workspaces = Workspaces.of_card(capability, target)
        self.fake_mode = _priv.new_fake_mode()
        self._entries = entries
        self.fast = None
        self.shadow: dict[str, Shadow] = {}
        self.cells = 0  # simulated cells run on this card
        self.failed = False  # a cell failed on it: a kept traceback may hold its objects

    def op_cache(self, on: bool):
        """The card's FakeOutputCache (made on first use), or None when ``on`` is False."""
        if not on:
            return None
        if self.fast is None:
            self.fast = FakeOutputCache(self.fake_mode, self._entries if self._entries is not None else {})
        return self.fast

    def begin_cell(self) -> None:
        """Before each cell on this card: what the fake mode keeps for fake constants freed
        since is dropped, and the op caches are kept within their bounds (a card lasts the
        whole notebook; with the tracker's own tables, see ``SimTracker.rearm``, a training
        step re-run a thousand times leaves the host's memory where it was)."""
        _priv.forget_dead_constants(self.fake_mode)
        bound_caches(self.fast.entries if self.fast is not None else self._entries)

    def _hold_context(self, context: CudaContext | None, target: CardSpec | None) -> None:
        """The card holds ``context`` (None: none counted) beside the allocator."""
        self.tracker.cuda_context = context
        self.tracker.card_memory = target.total_memory if target else 0

    def retarget(self, target: CardSpec | None) -> str | None:
        """Put the card's live blocks into a model of another card; a note, or None."""
        if target == self.target:
            return None
        old, self.target = self.target, target
        tr = self.tracker
        if tr.allocator is None:
            return None
        was = (tr.cuda_context, old)
        self._hold_context(cuda_context(target), target)
        new = CachingAllocatorModel(tr.allowed(target.total_memory) if target else None,
                                    tr.allocator.config)
        if tr.allocator.fraction_set and target is not None:  # set_per_process_memory_fraction
            new.capacity = tr.allowed(target.total_memory, tr.memory_fraction)
        try:
            for serial in sorted(tr.alloc_bytes):
                new.malloc(serial, tr.alloc_bytes[serial])
        except AllocatorFull:
            self.target = old
            self._hold_context(*was)
            raise SimulationUnsupported(
                f"the simulated GPU holds {format_bytes(tr.current['device'])} of tensors from "
                f"earlier cells ({format_bytes(tr.allocator.reserved)} reserved in the "
                f"allocator's segments), more than {target.name if target else 'the new card'} "
                "can take: run %gpusim reset (or memmagic.reset_simulated_gpu()) first") from None
        tr.allocator = new
        if tr.workspaces is not None and target is not None:
            # sizes for workspaces taken from now on; those held stay as they are
            fresh = Workspaces.of_card(target.capability, target)
            fresh.held = tr.workspaces.held
            fresh.conv_plans = tr.workspaces.conv_plans
            tr.workspaces = fresh
        tr.cuda_reserved_peak = new.reserved
        tr.cuda_allocated_peak = new.allocated
        was = old.name if old else "no target"
        now = target.name if target else "no target"
        return f"the simulated card changed from {was} to {now}: its tensors moved with it"

    def copy(self, leave_out: frozenset[str] = frozenset()) -> tuple["Card", list[str]]:
        """A new card that starts where this one is: copies of the simulated objects the
        notebook's names hold (same shapes, dtypes, devices, roles, ``.grad``, optimizer
        state), at the same addresses of a copy of the allocator model (its cached free
        blocks too), the same workspaces and default device. This card is left as it was.
        Notes say what was not copied. Used for what-if re-runs of a notebook's cell.
        ``leave_out``: names whose objects are not copied (what a failed cell bound before it
        failed, when its fixes are ranked from the state before it ran)."""
        old = self.tracker
        new = Card(self.kernels, self.target, self.capability, old.max_ops, old.max_seconds,
                   self._entries, self.alloc_config)
        new.fake_mode = self.fake_mode  # the copies are fakes of this mode
        new.cells = self.cells
        new.state.default_cuda = self.state.default_cuda
        new.state.cudnn_benchmark = self.state.cudnn_benchmark
        tr = new.tracker
        tr.persistent = True
        allocator, tr.allocator = tr.allocator, None  # the copy below replaces it
        names = {k: sh.value for k, sh in self.shadow.items() if k not in leave_out}
        copies, rekey, skipped = _copy_objects(self, new, names)
        for key, sh in self.shadow.items():
            if key in copies:
                new.shadow[key] = Shadow(sh.shown, copies[key])
        # the workspaces torch keeps for the life of the GPU
        if old.workspaces is not None:
            tr.workspaces = _copy.copy(old.workspaces)
            tr.workspaces.held = dict(old.workspaces.held)
            tr.workspaces.conv_plans = set(old.workspaces.conv_plans)
            for e in old.held_workspaces():
                rekey[e.serial] = tr.hold_workspace(e.nbytes)[0]
        if allocator is not None and old.allocator is not None:
            _copy_allocator(old, tr, allocator, rekey, packed=bool(leave_out))
        notes = [f"the what-if runs go without `{k}`: it could not be copied ({why}); a cell "
                 "that uses it fails on the copy" for k, why in skipped.items()]
        return new, notes + self._copy_notes(new, leave_out)

    def _copy_notes(self, new: "Card", leave_out: frozenset[str]) -> list[str]:
        """What :meth:`copy` left out, as report notes."""
        missing = self.tracker.current["device"] - new.tracker.current["device"]
        if missing > 0 and leave_out & set(self.shadow):
            return [f"the re-runs start from a copy of the notebook's simulated GPU without "
                    f"what {', '.join(sorted(leave_out & set(self.shadow)))} held "
                    f"({format_bytes(missing)} with anything no name reaches): the state "
                    "before the failed cell bound them"]
        if missing > 0:
            return [f"the what-if runs start from a copy of the notebook's simulated GPU; "
                    f"{format_bytes(missing)} on it that no name reaches (autograd graphs "
                    f"of earlier cells, objects held elsewhere) was not copied"]
        return []

    def discard(self) -> None:
        """Drop a copy made by :meth:`copy` (its objects, and its tracker's listening)."""
        self.shadow.clear()
        self.tracker.persistent = False
        self.tracker.close()

    def live_bytes(self) -> int:
        return self.tracker.current["device"]

    def reserved_bytes(self) -> int:
        a = self.tracker.allocator
        return a.reserved if a is not None else self.tracker.current["device"]


def _copy_objects(src: Card, dst: Card, names: dict[str, Any]
                  ) -> tuple[dict[str, Any], dict[int, int], dict[str, str]]:
    """Deep copies of ``names``' objects for ``dst``: each fake tensor of ``src`` becomes a
    fake on a storage of its own tracked on ``dst`` in the same pool and role (views share
    it), a real tensor a clone. An object whose own copy path fails on a simulated value
    (GradScaler's ``__getstate__`` reads its scale with ``.item()``) is copied from its
    attributes instead (:func:`.sandbox.copy_value`). (the copies, ``src``'s serial -> ``dst``'s
    serial, name -> why it could not be copied at all)."""
    old, tr, state, fake_mode = src.tracker, dst.tracker, dst.state, src.fake_mode
    rekey: dict[int, int] = {}
    bases: dict[int, Any] = {}   # storage key -> a tensor on the copy's storage

    def copy_tensor(t: torch.Tensor, memo: dict) -> torch.Tensor:
        if id(t) in memo:
            return memo[id(t)]
        if held_by(t) is not None:  # a wrapper subclass (a torchao weight): over copies
            out = memo[id(t)] = _copy_wrapper(t, lambda inner: copy_tensor(inner, memo))
            return out
        if not _priv.is_fake(t):  # a real tensor a simulated object holds: as torch does
            with torch.no_grad():
                out = t.clone()
            memo[id(t)] = out
            return out
        skey = _priv.storage_key(t.untyped_storage())
        entry = old.entry_of(t)
        with fake_mode, torch.no_grad():
            base = bases.get(skey)
            if _priv.fake_constant(t) is not None:
                out = t.clone()  # keeps its constant (values real code reads)
                base = out
            elif base is None or base.dtype != t.dtype:
                n = t.untyped_storage().nbytes() // t.element_size()
                base = torch.empty(n, dtype=t.dtype)
                out = base.as_strided(t.shape, t.stride(), t.storage_offset())
            else:
                out = base.as_strided(t.shape, t.stride(), t.storage_offset())
        if skey not in bases:
            bases[skey] = base
            if entry is not None:
                state.pending = entry.pool
                serial = tr.track(base, old.roles.get(entry.serial, Category.OTHER))
                if serial is not None:
                    rekey[entry.serial] = serial
        leaf = t.is_leaf
        if t.requires_grad:  # a tensor with a graph becomes a leaf (see the notes)
            out = out.detach().requires_grad_(True)
        if isinstance(t, torch.nn.Parameter):
            out = torch.nn.Parameter(out, t.requires_grad)
        memo[id(t)] = out
        if leaf and t.grad is not None:
            out.grad = copy_tensor(t.grad, memo)
        return out

    try:
        copies, skipped = _copy_names(names, copy_tensor)
    finally:
        state.pending = "host"
        bases.clear()  # copy_tensor is in a reference cycle: it must not hold tensors
    return copies, rekey, skipped


def _copy_wrapper(t: torch.Tensor, copy_inner: Callable[[torch.Tensor], torch.Tensor]
                  ) -> torch.Tensor:
    """A copy of the wrapper subclass ``t`` over ``copy_inner`` of each of its inner
    tensors, made by its class from them (``__tensor_unflatten__``) with ``t``'s device
    (as every wrapper its ops make meanwhile: a Parameter's detach), a Parameter if ``t`` is."""
    names, ctx = t.__tensor_flatten__()
    inner = {name: copy_inner(getattr(t, name)) for name in names}
    owner, attr = _priv.make_wrapper_subclass_slot()
    make, device = getattr(owner, attr), t.device

    def same_device(cls, size, *args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = device
        return make(cls, size, *args, **kwargs)

    patches = Patches()
    try:
        patches.set(owner, attr, staticmethod(same_device))
        out = type(t).__tensor_unflatten__(inner, ctx, t.shape, t.stride())
        return torch.nn.Parameter(out, t.requires_grad) if isinstance(t, torch.nn.Parameter) else out
    finally:
        patches.restore()


def _copy_names(names: dict[str, Any], copy_tensor: Callable[[torch.Tensor, dict], torch.Tensor]
                ) -> tuple[dict[str, Any], dict[str, str]]:
    """Deep copies of ``names``' objects with tensors copied by ``copy_tensor``; (the
    copies, name -> why it could not be copied)."""
    patches = Patches()
    try:
        patches.set(torch.Tensor, "__deepcopy__", copy_tensor)
        patches.set(torch.nn.Parameter, "__deepcopy__", copy_tensor)
        patches.set(_priv.FakeTensorMode, "__deepcopy__", _priv.fake_mode_deepcopy)
        patches.set(torch.optim.Optimizer, "__deepcopy__", copy_optimizer)
        copies, skipped, memo = {}, {}, {}
        for name, value in names.items():  # one memo: objects under two names stay one
            try:
                copies[name] = copy_value(value, memo)
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [""])[0]
                skipped[name] = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        memo.clear()
    finally:
        patches.restore()
    return copies, skipped


def _copy_allocator(old: SimTracker, tr: SimTracker, allocator: CachingAllocatorModel,
                    rekey: dict[int, int], packed: bool) -> None:
    """Give ``tr`` (a copy's tracker) the blocks of ``old``'s allocator model under the
    copy's serials: a copy of the model (its cache and fragmentation too), or with
    ``packed`` the blocks packed afresh into ``allocator``; and the memory fraction."""
    alloc_bytes = {rekey[s]: n for s, n in old.alloc_bytes.items() if s in rekey}
    if packed:
        # the state before a failed cell: its blocks packed afresh, not the cache
        # (and fragmentation) its failed run left
        for serial in sorted(alloc_bytes):
            allocator.malloc(serial, alloc_bytes[serial])
        tr.allocator = allocator
    else:
        tr.allocator = old.allocator.copy(rekey)
    tr.alloc_bytes = alloc_bytes
    tr.cuda_reserved_peak = tr.allocator.reserved
    tr.cuda_allocated_peak = tr.allocator.allocated
    # a memory fraction the cells set
    tr.allocator.set_capacity(old.allocator.capacity, fraction=old.allocator.fraction_set)
    tr.memory_fraction, tr.card_memory = old.memory_fraction, old.card_memory
    tr.cuda_context = old.cuda_context


@atomic
class SimSession:
    """The simulated GPU of one notebook (one IPython shell): see the module docstring."""

    def __init__(self) -> None:
        self.card: Card | None = None
        self.resets = 0
        _SESSIONS.add(self)

    def holds(self, namespace: Mapping[str, Any]) -> bool:
        """Whether names of ``namespace`` show objects of this simulated GPU."""
        card = self.card
        return card is not None and any(k in namespace and namespace[k] is sh.shown
                                        for k, sh in card.shadow.items())

    def card_for(self, kernels: str, target: CardSpec | None, capability: tuple[int, int],
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
        for sh in card.shadow.values():
            if isinstance(sh.shown, SimulatedValue):
                forget(sh.shown)
        card.shadow.clear()
        if card.failed:  # the last error's frames (kept for %debug) let go of its objects
            mode = card.fake_mode
            release_tracebacks(lambda v: _holds_fake_of(v, mode))
        card.tracker.persistent = False
        card.tracker.close()
        self.resets += 1
        return held

    def visible(self, namespace: dict) -> dict[str, Any]:
        """name -> the simulated object a simulated cell gets for it (names that still show
        what the last simulated cell left)."""
        card = self.card
        if card is None:
            return {}
        return {k: sh.value for k, sh in card.shadow.items()
                if k in namespace and namespace[k] is sh.shown}

    def status(self) -> str:
        card = self.card
        if card is None:
            return "simulated GPU: empty (no simulated cell has run since the last reset)"
        name = card.target.name if card.target else "no target card"
        names = ", ".join(sorted(card.shadow)) or "none"
        return (f"simulated GPU ({name}): {format_bytes(card.live_bytes())} allocated, "
                f"{format_bytes(card.reserved_bytes())} reserved; names holding simulated "
                f"objects: {names}")


_SESSIONS: "weakref.WeakSet[SimSession]" = weakref.WeakSet()


def session_of(namespace: Mapping[str, Any]) -> SimSession | None:
    """The notebook's simulated GPU whose objects names of ``namespace`` show (None when
    no name does): what a run that starts from a copy of it (``start_from=``) needs."""
    for session in list(_SESSIONS):
        if session.holds(namespace):
            return session
    return None


def _holds_fake_of(value: Any, mode: Any) -> bool:
    """Whether ``value`` reaches a fake tensor of ``mode`` (a card's simulated tensor)."""
    return any(_priv.is_fake(t) and getattr(t, "fake_mode", None) is mode
               for t in reachable_tensors(value, 2_000))


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
