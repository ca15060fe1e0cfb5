"""The simulated CUDA backend: runs a cell on fake tensors and reports GPU numbers."""

from __future__ import annotations


import copyreg
import functools
import io
import itertools
import logging
import pickle
import random
import re
import sys
from contextlib import ExitStack

from typing import Any, Callable, Iterable

import torch

from ...core import _torch_private as _priv
from ...report import Category, MemoryReport, Note, format_bytes
from ...core.tracking import Tracking, RoleHooks
from ...core.failures import release_call_closures, release_own_frames, user_line_in
from ..base import DECODE_STEPS, Backend, Outcome
from ..cpu import report_from_tracking
from .autocast import install_cuda_autocast_policy, make_autocast_classes
from .compat import install_compat
from .cudnn import SOURCE as CUDNN_SOURCE, cudnn_note, rnn_how
from .ddp import install_ddp
from .decode import decode_targets
from .repeats import install_repeats
from .cuda_api import SimulatedCuda
from .constants import INDEX_NUMEL, numel_bound
from .files import keep_overwritten_files
from .ranks import check_gpus_per_node, local_rank, node_gpus, rank_of
from .rewrite import DeviceRewriteMode
from .state import CPU, SimState, gpu_device, is_cuda_device
from .tracker import SimTracker
from .errors import (
    RERUN_HINT,
    SimulatedOutOfMemoryError,
    SimulationBudgetExceeded,
    SimulationError,
    SimulationUnsupported,
    StageWaits,
    size_error,
)
from .gpus import DEFAULT_CAPABILITY, CardSpec, resolve_target
from .kernels import install_cuda_kernels
from .op_cache import bound_caches
from ...core.patching import Patches
from .sandbox import Sandbox, sanitize_value
from .session import Card, SimSession

__all__ = ["SimBackend", "SIM_NOTES", "KERNELS", "clear_op_cache"]

KERNELS = ("cuda", "cpu")
SIM_NOTES = (
    "simulated on fake tensors: the allocator's figures leave out the CUDA context (hundreds "
    "of MiB on the card, outside the allocator) and buffers kernels allocate and free inside "
    "themselves, except those measured on a real GPU (cuBLAS and cuDNN workspaces, reductions' "
    "staging buffers, attention's scratch: the notes below say which ran)",
)
_CUDA_NOTE = ("CUDA behaviour modeled: 512-byte rounding, flash/memory-efficient attention, "
              "bool dropout masks, foreach optimizers, the CUDA autocast op policy")
_LIBRARY_NOTE = ("{lib} kernels ran ({ops}): their outputs count at the sizes of their fake "
                 "(meta) kernels; buffers the CUDA kernels allocate inside themselves are not "
                 "known and not counted")
_FLEX_NOTE = ("flex_attention ran as its fused kernel, as torch.compile(flex_attention) runs it "
              "on a GPU ({n} calls, backward included): the output and the log-sum-exp are "
              "saved, no score matrix is made; called without torch.compile (torch warns) it "
              "computes the whole batch x heads x queries x keys scores, which this leaves out")
_RNN_NOTE = ("{kinds} layers ran as cuDNN's: they keep cuDNN's training reserve (each step's gates "
             "and states) and take cuDNN's transient workspace beside each forward and the two "
             "backward passes ({how}){packed}; cuDNN's dropout state between layers is not counted")
_PACKED_NOTE = ("; {n} call{s} on packed sequences, their reserve and workspace sized as the "
                "padded batch (cuDNN's packed figures were not measured)")
# RNN stacks the simulated GPU leaves on the CPU kernels' memory
_CPU_RNN_NOTE = ("{calls} ran with the CPU kernels' memory (gates computed and saved step by "
                 "step), not cuDNN's (LSTM projections or cuDNN switched off: on a "
                 "GPU cuDNN keeps one training reserve per call and takes a transient workspace "
                 "beside its forward and backward, measured on {source}), so these layers' "
                 "activations and the peak can differ from a GPU's")
_CPU_RNN_NAMES = {"LSTM": "LSTM", "GRU": "GRU", "RNN_TANH": "RNN (tanh)", "RNN_RELU": "RNN (relu)"}
_CPU_NOTE = ("kernels='cpu': CPU kernels and defaults, the simulated device behaves like the "
             "CPU (for checking the simulation against --backend cpu)")
_FAST_ENTRIES: dict[tuple, dict] = {}  # FakeOutputCache entries per kernel configuration
_RANKS_NOTE = ("rank {r} of {n} GPUs: the figures are one GPU's; the cell ran on a fake "
               "process group (init_device_mesh, parallelize_module, fully_shard and DTensors "
               "as on a GPU of the job; collectives return at once), so NCCL's own buffers "
               "(hundreds of MiB a GPU, outside PyTorch's allocator) are not counted")
# a job's rank has no CPU run to fall back on (--backend cpu takes no --world-size)
_RANK_HINT = ("as one rank of {n} GPUs it has no CPU run to fall back on: run the job on its "
              "GPUs (torchrun), or simulate the part that fails without --world-size")
_WORKERS_NOTE = "DataLoader workers ran in-process (num_workers=0) in the simulation"
_ACTIVE: list = []  # the simulated run in progress (they do not nest)


def simulation_active() -> bool:
    """Whether a simulated run is in progress (code inside it runs on fake tensors)."""
    return bool(_ACTIVE)


def clear_op_cache() -> None:
    """Forget every op-cache entry, and FakeTensorMode's own dispatch cache: the next run
    of any cell starts cold, as in a fresh session."""
    _FAST_ENTRIES.clear()
    _priv.clear_fake_dispatch_cache()


class _OpCaches:
    """What a run in a forked child adds to the op caches, brought back to this process
    (:func:`memmagic.core.forked.run_all`'s ``carry``): the entries are metadata (sizes,
    strides, dtypes, devices), the same whichever process derived them; ``mark`` in the
    child before its run, ``since`` after it (the new entries, pickled; ops by name), and
    ``merge`` here (an entry this process has already is kept)."""

    def mark(self) -> dict[tuple, int]:
        return {cfg: len(d) for cfg, d in _FAST_ENTRIES.items()}

    def since(self, mark: dict[tuple, int]) -> bytes:
        new = [(cfg, list(itertools.islice(d.items(), mark.get(cfg, 0), None)))
               for cfg, d in _FAST_ENTRIES.items()
               if len(d) > mark.get(cfg, 0)]  # (emptied at its bound: nothing to bring)
        out = io.BytesIO()
        pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = {**copyreg.dispatch_table, _priv.OpOverload: _op_by_name}
        pickler.dump(new)
        return out.getvalue()

    def merge(self, data: bytes) -> None:
        for cfg, items in pickle.loads(data):
            entries = _FAST_ENTRIES.setdefault(cfg, {})
            for key, entry in items:
                entries.setdefault(key, entry)
            bound_caches(entries)


def _op_by_name(op: Any) -> tuple:
    return _overload, (op.namespace, op.__name__)  # ("aten", "view.default")


def _overload(namespace: str, name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


OP_CACHES = _OpCaches()


class _SimTracking(Tracking):
    """Tracking with the simulation's tracker (and no scan of the process's tensors)."""

    def __init__(self, tracker: SimTracker, namespace: dict | None = None) -> None:
        super().__init__(tracker.include, tracker.round_bytes, seed=False, roots=namespace)
        self.tracker = tracker
        self._hooks = RoleHooks(tracker, [namespace] if isinstance(namespace, dict) else None)


class _Installs:
    """What one run installs beyond attribute patches, each undone by ``patches`` (the
    run's one undo log): the CUDA kernels, and the CUDA autocast policy, installed when
    autocast is first entered (cells without autocast do not pay for it), never after
    the run (nothing would take it away)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.patches = Patches()
        self.running = True
        self.policy = None
        self.sdpa = None  # the SDPA kernel's counter of the backends it picked

    def install_kernels(self, capability: tuple[int, int], tracker: SimTracker) -> None:
        installed = install_cuda_kernels(self.patches, capability, tracker)
        self.sdpa = installed["sdpa"]
        self.patches.set(tracker, "own_kernels", installed["kernels"])

    def install_policy(self) -> None:
        if self.cuda and self.policy is None and self.running:
            self.policy = install_cuda_autocast_policy()
            self.patches.call_on_restore(functools.partial(_priv.destroy_library, self.policy))


class SimBackend(Backend):
    """Simulated CUDA device.

    ``gpu`` names a target card (see :data:`~memmagic.backends.sim.gpus.GPUS`),
    ``gpu_memory`` its size (``int`` bytes or ``'10GiB'``); with a target, a run whose
    reserved memory would exceed the card stops with a simulated
    ``torch.OutOfMemoryError`` at the op where the card would run out.
    ``op_cache=False`` makes FakeTensorMode compute every op's outputs (the op cache
    builds them from the inputs' metadata; it changes speed, never a byte).
    ``session``: a :class:`~.session.SimSession` whose simulated GPU the run uses and
    keeps (its tensors and the names that hold them last until the next cell; see
    :mod:`.session`); without one, every run starts from an empty card and leaves the
    namespace as it found it (names the run made become placeholders).
    ``start_from``: a SimSession whose simulated GPU each run starts from a *copy* of
    (:meth:`~.session.Card.copy`: the objects earlier simulated cells left, their memory
    and the allocator's cache), leaving the session as it was: what-if re-runs of a cell
    that uses those objects; ``leave_out`` names whose objects the copy leaves out.
    ``decode="run"`` simulates every decode step of transformers' ``generate()`` op by op
    (by default most are read off a line through three that ran: :mod:`.decode`).
    ``kernels="cpu"`` selects the CPU's kernels and defaults instead of CUDA's (the
    simulated device then behaves like the CPU: used to check the simulation against
    ``--backend cpu``). ``max_ops`` and ``max_seconds`` bound a run (``max_seconds``:
    :attr:`DEFAULT_MAX_SECONDS` when None).
    """

    name = "sim"
    DEFAULT_MAX_SECONDS = 120.0

    def __init__(self, gpu: str | CardSpec | None = None, gpu_memory: int | str | None = None,
                 kernels: str = "cuda", max_ops: int = 2_000_000,
                 max_seconds: float | None = None,
                 op_cache: bool = True, session: SimSession | None = None,
                 start_from: SimSession | None = None, leave_out: Iterable[str] = (),
                 world_size: int | None = None, rank: int | None = None,
                 mailbox: dict | None = None, gpus_per_node: int | None = None,
                 decode: str = "evaluate", **options: Any) -> None:
        if options:
            raise TypeError(f"the sim backend takes gpu=, gpu_memory=, kernels=, max_ops=, "
                            f"max_seconds=, op_cache=, session=, start_from=, leave_out=, "
                            f"world_size=, rank=, mailbox=, gpus_per_node=, decode=; got "
                            f"{sorted(options)}")
        if decode not in DECODE_STEPS:
            raise ValueError(f"decode takes one of {DECODE_STEPS} (generate()'s decode steps "
                             f"read off a line, or each run op by op), not {decode!r}")
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, not {kernels!r}")
        if max_seconds is None:
            max_seconds = self.DEFAULT_MAX_SECONDS
        if int(max_ops) <= 0 or float(max_seconds) <= 0:
            raise ValueError("max_ops and max_seconds must be positive")
        self.target = resolve_target(gpu, gpu_memory)
        self.kernels = kernels
        self.max_ops = int(max_ops)
        self.max_seconds = float(max_seconds)
        self.op_cache = bool(op_cache)
        self.decode = decode
        if session is not None and not isinstance(session, SimSession):
            raise TypeError(f"session must be a SimSession, not {type(session).__name__}")
        if start_from is not None and not isinstance(start_from, SimSession):
            raise TypeError(f"start_from must be a SimSession, not {type(start_from).__name__}")
        if session is not None and start_from is not None:
            raise TypeError("give session= (run on the notebook's simulated GPU) or start_from= "
                            "(run on a copy of it), not both")
        if world_size is not None:
            if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
                raise ValueError(f"world_size must be a number of GPUs, 2 or more, not {world_size!r}")
            if session is not None:
                raise TypeError("a world_size run cannot stay on the notebook's simulated GPU "
                                "(its process group ends with the run): give start_from=")
        if rank is not None and (world_size is None or isinstance(rank, bool)
                                 or not isinstance(rank, int) or not 0 <= rank < world_size):
            raise ValueError(f"rank takes one of the job's ranks, 0 to world_size - 1 (a "
                             f"world_size is needed), not {rank!r}")
        if gpus_per_node is not None:
            if world_size is None:
                raise ValueError("gpus_per_node is the nodes' size of a job: give world_size too")
            check_gpus_per_node(world_size, gpus_per_node)
        self.world_size = world_size
        self.rank = rank or 0
        self.gpus_per_node = gpus_per_node
        # what the job's earlier ranks sent this one (pipeline stages' metadata): shared by
        # the runs of one job's ranks (memmagic.jobs), else the run's own
        self.mailbox = mailbox
        self.session = session
        self.start_from = start_from
        self.leave_out = frozenset(leave_out)
        # ops, op-cache hits, misses and passes (left to FakeTensorMode) of the last run
        self.last_run_stats: dict[str, int] = {}

    @property
    def device_name(self) -> str:
        rank = f", rank {self.rank} of {self.world_size} GPUs" if self.world_size else ""
        index = local_rank(self.world_size, self.rank, self.gpus_per_node) if self.world_size else 0
        return f"simulated cuda:{index} ({self.target.name if self.target else 'no target'}{rank})"

    def measure(self, fn: Callable[[], Any]) -> Outcome:
        """Measure a zero-argument callable; the globals of a plain function are sandboxed
        (best effort: objects reached through closures are not)."""
        import inspect

        ns = getattr(inspect.unwrap(fn), "__globals__", None)  # a compiled function's own
        if not isinstance(ns, dict) or ns is vars(sys.modules.get("builtins")):
            ns = {}
        return self.execute(lambda _ns: fn(), ns)

    # -- the run ----------------------------------------------------------------------------
    def execute(self, run: Callable[[dict], Any], namespace: dict) -> Outcome:
        cuda = self.kernels == "cuda"
        target = self.target
        capability = target.capability if target else DEFAULT_CAPABILITY
        # op outputs from metadata, shared by every run with the same kernels (cuda kernels
        # differ with the GPU's compute capability)
        entries = _FAST_ENTRIES.setdefault((self.kernels, capability if cuda else None), {})
        notes: list[str] = []
        if _ACTIVE:
            raise SimulationUnsupported(
                "a simulated measurement cannot run inside another one (a measure(..., "
                "backend='sim'), a Cell's run or %%gpumem --backend sim in a simulated cell): "
                "measure the inner code in a cell of its own; after %gpusim on every cell is "
                "a simulated one, so run it after %gpusim off")
        copied = False
        if self.session is not None:
            card, session_notes = self.session.card_for(self.kernels, target, capability,
                                                        self.max_ops, self.max_seconds, entries)
            notes += session_notes
        elif self.start_from is not None and self.start_from.card is not None \
                and self.start_from.card.kernels == self.kernels:
            card, copy_notes = self._copy_card(self.start_from.card, target, self.leave_out)
            notes += copy_notes
            copied = True
        else:
            card = Card(self.kernels, target, capability, self.max_ops, self.max_seconds, entries)
        # this frame outlives the call when a caller keeps the cell's error (its traceback's
        # frames link back here): it must not hold the card
        box = [card]
        del card
        if self.world_size is None:
            return self._execute_on(box, run, namespace, notes, copied)
        notes.append(_RANKS_NOTE.format(r=self.rank, n=self.world_size))
        # the job's card is a copy
        box[0].state.node_gpus = node_gpus(self.world_size, self.gpus_per_node)
        with ExitStack() as stack:
            try:
                stack.enter_context(rank_of(self.world_size, self.rank, self.mailbox,
                                            self.gpus_per_node))
            except RuntimeError as exc:  # a process group exists already
                box.clear()
                raise SimulationUnsupported(f"world_size={self.world_size}: {exc}") from None
            return self._execute_on(box, run, namespace, notes, copied)

    @staticmethod
    def _copy_card(card: Card, target: CardSpec | None,
                   leave_out: frozenset[str]) -> tuple[Card, list[str]]:
        copy, notes = card.copy(leave_out)
        try:
            note = copy.retarget(target)
        except SimulationUnsupported:
            copy.discard()
            raise SimulationUnsupported(
                f"the objects earlier simulated cells left on the simulated GPU "
                f"({card.live_bytes():,} B) do not fit on {target.name if target else 'that card'}: "
                "pick a larger card") from None
        if note:
            notes.append(f"the what-if run's copy of the notebook's simulated GPU: {note}")
        return copy, notes

    def _execute_on(self, box: list[Card], run: Callable[[dict], Any], namespace: dict,
                    notes: list[str], copied: bool) -> Outcome:
        """The run on ``box``'s card (a copy is discarded afterwards, in this frame: the
        cell's error holds it, and whoever keeps the error clears it)."""
        card = box.pop()
        try:
            return self._run_on(card, run, namespace, notes,
                                card.shadow if (self.session is not None or copied) else None,
                                copied)
        finally:
            if copied:
                card.discard()
            del card

    def _run_on(self, card: Card, run: Callable[[dict], Any], namespace: dict,
                notes: list[str], shadow: dict | None, whatif: bool = False) -> Outcome:
        cuda = self.kernels == "cuda"
        state, tracker = card.state, card.tracker
        state.begin_run()
        tracker.rearm(self.max_ops, self.max_seconds)
        card.begin_cell()
        fast = card.op_cache(self.op_cache)
        tracker.fast = fast
        counts0 = _cache_counts(fast)
        tracking = _SimTracking(tracker, namespace)
        installs = _Installs(cuda)
        autocast = make_autocast_classes(cuda, installs.install_policy)
        sandbox = Sandbox(namespace, card.fake_mode, self._replacements(autocast), shadow, whatif)
        value = error = shown = None
        try:
            value, shown = self._simulate(card, run, namespace, tracking, sandbox, installs,
                                          autocast, notes)
        except BaseException as exc:  # re-raised by the caller after rendering
            error = _explain(exc, self.world_size)
            # the simulation's own finished frames (dispatch, tracker) hold the op's fake
            # tensors: a caller keeping the error must not keep them on the card
            release_own_frames(exc.__traceback__)
            # nor may the closures the tracker's module hooks made torch call through
            # (frame.clear() leaves them): released frames free the step, as on a GPU
            release_call_closures(exc.__traceback__)
            card.failed = True
        card.cells += 1
        if tracking.result is None:  # failed before the cell ran (the sandbox, the seed)
            assert error is not None
            raise error
        value = sanitize_value(value, shown=shown, live=shadow is not None)
        self.last_run_stats = {"ops": tracker.ops, **{
            k: n - counts0[k] for k, n in _cache_counts(fast).items()}}
        if self.session is not None and card.shadow:
            notes.append("the simulated GPU lasts the whole notebook: "
                         + ", ".join(sorted(card.shadow)) + " hold simulated objects for later "
                         "simulated cells (%gpusim reset empties it)")
        if cuda and not state.cuda_seen and error is None and not tracker.peak["device"]:
            notes.append("no tensor reached the simulated GPU in this cell: everything ran on "
                         "the host (a device chosen in a real cell, where no GPU was found, is "
                         "'cpu': choose it in a simulated cell, or write device='cuda')")
        return Outcome(self._report(tracking, tracker, state, sandbox, notes, error, installs.sdpa),
                       None if error else value, error)

    def _simulate(self, card: Card, run: Callable[[dict], Any], namespace: dict,
                  tracking: _SimTracking, sandbox: Sandbox, installs: _Installs,
                  autocast: dict[str, Any], notes: list[str]) -> tuple[Any, str | None]:
        """Install the simulation, run the cell on fakes, undo every install (one undo log,
        also after an exception); the cell's value and its repr as a GPU run shows it."""
        state, tracker, patches = card.state, card.tracker, installs.patches
        patches.call_on_restore(functools.partial(_restore_globals, _save_globals()))
        _keep_cudnn_benchmark(patches, state)
        _ACTIVE.append(self)
        patches.call_on_restore(lambda: _ACTIVE.remove(self))
        try:
            _install(patches, state, tracker, self.target, autocast, notes, self.decode)
            if installs.cuda:
                installs.install_kernels(card.capability, tracker)
                if torch.is_autocast_enabled("cpu"):  # autocast already on: now
                    installs.install_policy()
            patches.call_on_restore(sandbox.exit)
            sandbox.enter()
            _seed(tracker, state, sandbox, namespace)
            sandbox.release()
            with card.fake_mode, tracking, DeviceRewriteMode(state):
                prepare = getattr(run, "prepare", None)
                if prepare is not None:  # the run's setup (a knob's), not measured
                    prepare(namespace)
                    tracker.restart()
                tracker.start_clock()
                value = run(namespace)
                return value, _shown(value)  # its repr, while fake tensors print as on a GPU
        finally:
            installs.running = False
            patches.restore()

    def _replacements(self, autocast: dict[str, Any]) -> dict[int, Any]:
        import torch.cuda.amp

        return {id(torch.autocast): autocast["autocast"],
                id(torch.cuda.amp.autocast): autocast["cuda_amp_autocast"]}

    # -- the report -------------------------------------------------------------------------
    def _report(self, tracking: _SimTracking, tracker: SimTracker, state: SimState,
                sandbox: Sandbox, notes: list[str], error: BaseException | None,
                sdpa) -> MemoryReport:
        target = self.target
        all_notes = list(SIM_NOTES)
        all_notes.append(_CUDA_NOTE if state.cuda else _CPU_NOTE)
        all_notes += _kernel_notes(state, sdpa)
        all_notes += notes
        ws = tracker.workspaces.describe() if tracker.workspaces is not None else None
        if ws:
            all_notes.append(ws)
        if state.data_reads:
            all_notes.append(_reads_note(state.read_ops))
        if sandbox.not_isolated:
            all_notes.append("could not isolate " + ", ".join(sandbox.not_isolated)
                             + ": Python-level changes the cell made to them are kept")
        if isinstance(error, SimulatedOutOfMemoryError):
            all_notes.append(f"out of memory on {target.name if target else 'the GPU'}: "
                             "the run stopped where the card would run out")
        if target is not None and target.resized_from is not None:
            card = target.resized_from
            all_notes.append(Note(f"card size overridden: the {card.name}'s kernels with "
                                  f"{format_bytes(target.total_memory)} instead of its "
                                  f"{format_bytes(card.total_memory)}", "card"))
        if target is not None and state.cuda and tracker.context_bytes:
            all_notes.append(f"the verdict counts the CUDA context, "
                             f"{format_bytes(tracker.context_bytes)}, beside the allocator's figures "
                             f"(which leave it out) and the allocator can only reserve what it "
                             f"leaves: {tracker.cuda_context.basis}")
        elif target is not None:
            all_notes.append("the card's size is a budget for PyTorch's allocator (a bare "
                             "size): the CUDA context, hundreds of MiB on a real card, is not "
                             "taken from it")
        conf = _alloc_conf(tracker.allocator) if state.cuda else None
        if conf:
            all_notes.append(conf)
        extra: dict[str, Any] = {}
        if state.cuda:
            a = tracker.allocator
            extra.update(reserved_peak=a.reserved_peak, reserved_after=a.reserved,
                         host_peak=tracker.peak["host"])
        if target is not None:
            extra.update(gpu_name=target.name, gpu_memory=target.total_memory,
                         context=(tracker.context_bytes or None) if state.cuda else None)
        oom = isinstance(error, SimulatedOutOfMemoryError)
        if oom:
            extra.update(failed_request=error.size, live_at_failure=tracker.oom_live)
        report = report_from_tracking(tracking, "sim", self.device_name, tuple(all_notes),
                                      error, **extra)
        if oom and report.trace is not None and tracker.oom_event >= 0:
            report.trace.failure_event = tracker.oom_event
            report.trace.failure_op = tracker.oom_op
        return report


# -- what a run installs (every one through the run's Patches) ---------------------------------
def _install(patches: Patches, state: SimState, tracker: SimTracker, target: CardSpec | None,
             autocast: dict[str, Any], notes: list[str], decode: str) -> None:
    """Everything a simulated run changes in torch and in libraries."""
    _priv.build_dynamo_rules()  # from torch's own functions, before any is replaced
    # a meta kernel's error reaches the user as the op's own error: fake tensors' log of
    # it (some 40 lines on stderr, with the dispatcher's frames) would only repeat it
    patches.set(logging.getLogger("torch._subclasses.fake_tensor"), "disabled", True)
    _install_autocast(patches, autocast)
    _install_devices(patches, state)
    _install_generator(patches, state)
    SimulatedCuda(tracker, target, notes).install(patches, autocast)
    # generate()'s decode steps read off a line (.decode), unless each is to run
    install_compat(patches, notes, target, decode_targets(tracker, notes, decode == "evaluate"))
    if decode == "evaluate":  # repeated forward passes with gradients off, likewise
        install_repeats(patches, tracker, state, notes)
    install_ddp(patches, state, notes)
    keep_overwritten_files(patches, notes)
    _install_torch_adjustments(patches, state, notes)
    _install_value_checks(patches, state)
    # flex_attention reaches the tracker as an op: its outputs are the fused kernel's, as
    # FakeTensorMode makes them (see _FLEX_NOTE)
    patches.enter(_priv.hops_through_mode(SimTracker, _priv.attention_hops()))


def _install_autocast(patches: Patches, autocast: dict[str, Any]) -> None:
    import torch.amp.autocast_mode as amp_mode

    for mod in (torch, torch.amp, amp_mode):
        patches.set(mod, "autocast", autocast["autocast"])
    patches.set(torch, "is_autocast_enabled", autocast["is_autocast_enabled"])
    patches.set(torch, "get_autocast_dtype", autocast["get_autocast_dtype"])
    patches.set(torch, "get_autocast_gpu_dtype", autocast["get_autocast_gpu_dtype"])


def _install_devices(patches: Patches, state: SimState) -> None:
    """``FakeTensor.device`` as the simulated device, and the default device."""
    def set_default_device(device) -> None:
        if device is None:
            state.default_cuda = False
            return
        cuda = is_cuda_device(device)
        if cuda is None or (not cuda and torch.device(device).type != "cpu"):
            raise SimulationUnsupported(
                f"torch.set_default_device({device!r}) cannot be simulated; {RERUN_HINT}")
        state.default_cuda = bool(cuda)

    def get_default_device() -> torch.device:
        return gpu_device() if state.default_cuda and state.cuda else CPU

    real_device = _priv.fake_tensor_device_getter()

    def device(t):
        real = real_device(t)
        if state.in_dispatch:  # torch's own dispatch code: the real (CPU) device
            return real
        return state.fake_device(t, real)

    patches.set(_priv.FakeTensor, "device", property(device))

    owner, attr = _priv.make_wrapper_subclass_slot()
    make_wrapper = getattr(owner, attr)

    def make_wrapper_subclass(cls, size, *args, **kwargs):
        # a wrapper subclass takes its device from an inner tensor's: cuda:0 when user code
        # asks one on the simulated GPU, the real CPU when torch's dispatch code does (a
        # wrapper's own op); both are the simulated GPU when the op runs there
        dev = kwargs.get("device")
        if (dev is not None and state.cuda and state.in_dispatch and state.pending == "device"
                and torch.device(dev).type == "cpu"):
            kwargs["device"] = gpu_device()
        return make_wrapper(cls, size, *args, **kwargs)

    patches.set(owner, attr, staticmethod(make_wrapper_subclass))
    # deepcopy of a fake tensor (nn.TransformerEncoder's layer clones) keeps its fake
    # mode: a copied mode frees torch's storage weakrefs twice and crashes the process
    patches.set(_priv.FakeTensorMode, "__deepcopy__", _priv.fake_mode_deepcopy)
    patches.set(torch, "set_default_device", set_default_device)
    patches.set(torch, "get_default_device", get_default_device)
    storage_ptr = torch.UntypedStorage.data_ptr

    def data_ptr(storage):  # a simulated storage's address; torch's for the others
        address = state.storage_ptr(storage)
        return storage_ptr(storage) if address is None else address

    patches.set(torch.UntypedStorage, "data_ptr", data_ptr)


_TORCH_GENERATOR = torch.Generator


class _GeneratorKind(type(_TORCH_GENERATOR)):  # type: ignore[misc]
    """torch's own generators are instances of the stand-in too."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _TORCH_GENERATOR)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _TORCH_GENERATOR)


class _Generator(_TORCH_GENERATOR, metaclass=_GeneratorKind):
    """``torch.Generator`` during a simulation (:func:`_install_generator`): one made for
    the GPU (``torch.Generator(device="cuda")``: nanochat's sampling, a diffusers
    pipeline's seed) is a generator of the host's kind, which the simulation's tensors
    (host tensors standing for the GPU's) draw from, that says it is on the simulated GPU;
    every other is torch's own. ``state``: the run's, while installed."""

    state: SimState | None = None

    def __new__(cls, device: Any = "cpu") -> Any:
        if not is_cuda_device(device):
            return _TORCH_GENERATOR(device)
        return _TORCH_GENERATOR.__new__(cls, "cpu")

    def __init__(self, device: Any = "cpu") -> None:
        pass

    @property
    def device(self) -> torch.device:
        state = type(self).state
        return gpu_device() if state is not None and state.cuda else CPU

    def __deepcopy__(self, memo: dict) -> Any:  # (a copy of the card's, for a what-if run)
        new = _TORCH_GENERATOR.__new__(type(self), "cpu")
        new.set_state(self.get_state())
        return new


_Generator.__name__ = _Generator.__qualname__ = "Generator"


def _install_generator(patches: Patches, state: SimState) -> None:
    """``torch.Generator`` as :class:`_Generator` for the run (``state``: whether its
    generators on the GPU say so)."""
    patches.set(_Generator, "state", state)
    patches.set(torch, "Generator", _Generator)


def _install_torch_adjustments(patches: Patches, state: SimState, notes: list[str]) -> None:
    """torch's own code paths a simulation needs changed (swaps, constants, cuDNN's
    probe, DataLoader workers)."""
    swap = torch.utils.swap_tensors

    def swap_tensors(t1, t2):  # nn.Module._apply swaps fake parameters; weakrefs block it
        try:
            swap(t1, t2)
        except RuntimeError:
            if not (_priv.is_fake(t1) or _priv.is_fake(t2)):
                raise
            if not _priv.can_set_data(t1, t2):  # meta -> the GPU (to_empty)
                _priv.swap_held_tensors(t1, t2)
            else:
                with torch.no_grad():
                    t1.data = t2.detach()
        state.refilled(t1)

    patches.set(torch.utils, "swap_tensors", swap_tensors)
    # values that follow from constants and shapes (arange, linspace, full, masks made
    # from them) stay real up to numel_bound elements: control flow on them is right
    patches.set(*_priv.constant_numel_limit_holder(), INDEX_NUMEL)
    cls, name = _priv.may_turn_const_holder()
    may_turn = getattr(cls, name)

    def may_turn_const(mode, t) -> bool:
        return may_turn(mode, t) and t.numel() <= numel_bound(t.dtype)

    patches.set(cls, name, may_turn_const)
    import torch.backends.cudnn as cudnn

    # nn.RNNBase asks whether cuDNN can take its weights (it warns on a CPU build)
    patches.set(cudnn, "is_acceptable", lambda tensor: False)
    loader_cls, get_iter_attr = _priv.dataloader_iterator_slot()
    get_iter = getattr(loader_cls, get_iter_attr)

    def _get_iterator(loader):
        n = loader.num_workers
        if n <= 0:
            return get_iter(loader)
        if "workers" not in " ".join(notes):
            notes.append("DataLoader workers ran in-process (num_workers=0) in the simulation")
        # the loader's own attribute, for this call only (per call, not the run's undo log)
        object.__setattr__(loader, "num_workers", 0)
        try:
            return _priv.single_process_loader_iter(loader)
        finally:
            object.__setattr__(loader, "num_workers", n)

    patches.set(loader_cls, get_iter_attr, _get_iterator)


def _install_value_checks(patches: Patches, state: SimState) -> None:
    """torch.testing's checks of values (``assert_close``, the deprecated
    ``assert_allclose``): each bool they read of values the simulation does not have is
    taken to hold, noted, as ``torch.allclose`` is; their checks of shapes, dtypes and
    devices run as they are."""
    import torch.testing

    for name in ("assert_close", "assert_allclose"):
        original = getattr(torch.testing, name, None)
        if original is None:
            continue

        def check(*args, _original=original, _name=name, **kwargs):
            prev, state.holding = state.holding, f"torch.testing.{_name}"
            try:
                return _original(*args, **kwargs)
            finally:
                state.holding = prev

        patches.set(torch.testing, name, check)


def _cache_counts(fast) -> dict[str, int]:
    """The op cache's counters (zeros without one); ``cache_derived``: hits whose entry a
    Meta kernel derived in this run (see FakeOutputCache)."""
    if fast is None:
        return {"cache_hits": 0, "cache_misses": 0, "cache_passes": 0, "cache_derived": 0}
    return {"cache_hits": fast.hits, "cache_misses": fast.misses, "cache_passes": fast.passes,
            "cache_derived": fast.derived}


# -- helpers ----------------------------------------------------------------------------------
def _alloc_conf(allocator) -> str | None:
    """The note naming the allocator settings the card was made with (read from
    PYTORCH_CUDA_ALLOC_CONF when it was made, as torch reads them when CUDA starts) that
    the allocator model does not follow; None when it follows them all."""
    config = getattr(allocator, "config", None)
    if config is None or not config.unmodelled:
        return None
    name = config.source.split("=", 1)[0]
    items = ",".join(config.unmodelled)
    verb = "is" if len(config.unmodelled) == 1 else "are"
    if config.modelled:
        follows = (f"reserved memory follows {','.join(config.modelled)} and the default "
                   "configuration otherwise")
    else:
        follows = "reserved memory follows the caching allocator's default configuration"
    return f"{name}={items} {verb} not modelled: {follows} (allocated memory does not depend on it)"


def _shown(value: Any) -> str | None:
    """The repr a GPU run would show for a cell's value (None: not one to show)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return None
    try:
        text = repr(value)
    except Exception:
        return None
    return text if len(text) <= 5000 else text[:5000] + " ..."


def _kernel_notes(state: SimState, sdpa) -> list[str]:
    """The report's notes on the kernels a run took as CUDA's: cuDNN's RNNs and convolutions,
    the RNN stacks left on the CPU kernels' memory, flex_attention, quantized
    weights' libraries, the attention backends SDPA picked."""
    out = []
    if state.cuda and state.cudnn_rnn_calls:
        calls = state.cudnn_rnn_calls
        kinds = [k for k in ("LSTM", "GRU", "RNN") if k in calls]
        n = calls.get("packed", 0)
        packed = _PACKED_NOTE.format(n=n, s="s" * (n > 1)) if n else ""
        out.append(_RNN_NOTE.format(kinds=", ".join(kinds), how=rnn_how(state.cudnn_rnn_workspaces),
                                    packed=packed))
    if state.cuda and state.cpu_rnn_calls:
        calls = ", ".join(f"{n} {_CPU_RNN_NAMES[name]} call{'s' * (n > 1)}"
                          for name, n in sorted(state.cpu_rnn_calls.items()))
        out.append(_CPU_RNN_NOTE.format(calls=calls, source=CUDNN_SOURCE))
    if state.flex_attention_calls:
        out.append(_FLEX_NOTE.format(n=state.flex_attention_calls))
    if state.cudnn_workspaces:
        out.append(cudnn_note(state.cudnn_workspaces))
    for lib, ops in sorted(state.library_kernels.items()):
        out.append(_LIBRARY_NOTE.format(lib=lib, ops=", ".join(sorted(ops))))
    if sdpa is not None and sdpa.counts:
        kinds = ", ".join(f"{k} {v}x" for k, v in sorted(sdpa.counts.items()))
        out.append(f"scaled_dot_product_attention ran as CUDA would pick it: {kinds}")
    return out


def _reads_note(read_ops: dict) -> str:
    """Which lines of the cell read values the simulation does not have."""
    lines: dict[str, set[str]] = {}
    hidden: set[str] = set()
    for (where, what), _n in read_ops.items():
        if where is None:
            hidden.add(what)
        else:
            lines.setdefault(where, set()).add(what)
    parts = [f"{where} ({', '.join(sorted(whats))})" for where, whats in lines.items()][:8]
    if len(lines) > 8:
        parts.append(f"and {len(lines) - 8} more line(s)")
    if hidden:
        parts.append(f"library code ({', '.join(sorted(hidden))})")
    return ("values that depend on data were read at " + "; ".join(parts) + ": a simulation "
            "has none, so placeholders stood in (1.0 and 0, printed with '(simulated)'; False "
            "for bools) and code that branches on them may take another path than on a GPU")


def _seed(tracker: SimTracker, state: SimState, sandbox: Sandbox, namespace: dict) -> None:
    """Count the fake copies of the namespace's tensors in ``before`` (on the host: they are
    CPU tensors of earlier cells), with their roles."""
    roles: dict[int, Category] = {}
    for _, fake in sandbox.fakes:
        roles[id(fake)] = Category.PARAMETERS if isinstance(fake, torch.nn.Parameter) else Category.OTHER
    for value in namespace.values():
        if isinstance(value, torch.nn.Module):
            for m in value.modules():
                for b in _priv.own_buffers(m).values():
                    if b is not None:
                        roles[id(b)] = Category.BUFFERS
                for p in _priv.own_parameters(m).values():
                    if p is not None and p.grad is not None:
                        roles[id(p.grad)] = Category.GRADIENTS
        elif isinstance(value, torch.optim.Optimizer):
            for st in value.state.values():
                for v in st.values() if isinstance(st, dict) else ():
                    if isinstance(v, torch.Tensor):
                        roles[id(v)] = Category.OPTIMIZER_STATE
    tensors = {}
    for _, fake in sandbox.fakes:
        tensors[id(fake)] = fake
        g = fake.grad if isinstance(fake, torch.nn.Parameter) else None
        if g is not None:
            tensors[id(g)] = g
    state.pending = "host" if state.cuda else "device"
    tracker.seed((t, roles.get(i, Category.OTHER)) for i, t in tensors.items())


def _keep_cudnn_benchmark(patches: Patches, state: SimState) -> None:
    """``torch.backends.cudnn.benchmark`` as the simulated GPU's cells left it: a cell that
    sets it sets it for the later cells of the notebook's simulated GPU, as on a GPU, while
    the process's own flag is put back after each simulated cell (with the other globals)."""
    if state.cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = state.cudnn_benchmark
    patches.call_on_restore(lambda: setattr(state, "cudnn_benchmark", torch.backends.cudnn.benchmark))


def _save_globals() -> dict[str, Any]:
    out: dict[str, Any] = {
        "rng": torch.get_rng_state(), "py_rng": random.getstate(),
        "dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(),
        "det": torch.are_deterministic_algorithms_enabled(),
        "det_warn": torch.is_deterministic_algorithms_warn_only_enabled(),
        "tf32": _tf32_state(),
        "cudnn": (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic),
        "sdp": (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled()),
        "autocast": [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu",)],
        "function_modes": _priv.function_mode_depth(),
    }
    np = sys.modules.get("numpy")
    if np is not None:
        out["np_rng"] = np.random.get_state()
    return out


# torch's TF32 settings in its newer API (torch.backends.<backend>.fp32_precision, per
# backend and op; "" is torch.backends itself), beside the older flags
_FP32_PRECISIONS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn",
                    "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


def _precision_holder(path: str) -> Any:
    obj: Any = torch.backends
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part, None)
    return obj if hasattr(obj, "fp32_precision") else None


def _tf32_state() -> tuple:
    """(the older flags: float32 matmul precision, cuDNN's and cuBLAS's allow_tf32; None
    where the settings mix the two APIs, which torch then refuses to read: a cell or a
    library set ``torch.backends.fp32_precision = "tf32"`` (transformers'
    ``TrainingArguments(tf32=True)`` does), the newer API's value per backend)."""
    newer = {path: holder.fp32_precision for path in _FP32_PRECISIONS
             if (holder := _precision_holder(path)) is not None}
    b = torch.backends
    try:
        older = (torch.get_float32_matmul_precision(), b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32)
    except RuntimeError:
        older = None
    return older, newer


def _set_tf32_state(state: tuple) -> None:
    """Put back what :func:`_tf32_state` read: the older flags first (setting them sets the
    newer values too), then each newer value as it was."""
    older, newer = state
    b = torch.backends
    if older is not None:
        torch.set_float32_matmul_precision(older[0])
        b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32 = older[1], older[2]
    for path, value in newer.items():
        _precision_holder(path).fp32_precision = value


def _restore_globals(saved: dict[str, Any]) -> None:
    torch.set_rng_state(saved["rng"])
    random.setstate(saved["py_rng"])
    torch.set_default_dtype(saved["dtype"])
    torch.set_grad_enabled(saved["grad"])
    torch.use_deterministic_algorithms(saved["det"], warn_only=saved["det_warn"])
    _set_tf32_state(saved["tf32"])
    b = torch.backends
    b.cudnn.benchmark, b.cudnn.deterministic = saved["cudnn"]
    flash, eff, math = saved["sdp"]
    b.cuda.enable_flash_sdp(flash)
    b.cuda.enable_mem_efficient_sdp(eff)
    b.cuda.enable_math_sdp(math)
    for d, enabled, dtype in saved["autocast"]:
        torch.set_autocast_enabled(d, enabled)
        torch.set_autocast_dtype(d, dtype)
    if "np_rng" in saved:
        sys.modules["numpy"].random.set_state(saved["np_rng"])


# torch's error when a library's Parameter subclass wraps a simulated (fake) tensor
_SUBCLASS = re.compile(r"Creating a new Tensor subclass (\w+) but the raw Tensor object is "
                       r"already associated to a python object of type FakeTensor")
# torch's error when a device mesh asks for more GPUs than the job (--world-size) has
_MESH_TOO_BIG = re.compile(r"Mesh should not be bigger than default world size (\d+), but found "
                           r"(\d+) ranks")
_SMELLS = ("not compiled with CUDA", "NVIDIA driver", "CUDA driver", "Cannot access data pointer",
           "FakeTensor", "fake tensor", "data-dependent", "data dependent", "Cannot access storage",
           "accelerator", "CUDA", "cuda")
# what a library says when the card is too old for a feature (transformers' "--tf32 requires
# Ampere or a newer GPU arch, cuda>=11"): the simulated card's answer, as on that card, not a
# failure of the simulation, though the message names CUDA
_CARD_TOO_OLD = ("Ampere", "Hopper", "Blackwell", "compute capability", "GPU arch")


def _explain(exc: BaseException, world_size: int | None = None) -> BaseException:
    """The cell's exception, or a SimulationUnsupported naming the line when the failure
    comes from what a simulation cannot do (and what to do instead: ``world_size``, a job's
    rank, has no CPU run)."""
    exc = size_error(exc) or exc  # sizes past 64 bits: CUDA's words, not fake tensors' frames
    if isinstance(exc, (SimulationError, SimulatedOutOfMemoryError)) or not isinstance(exc, Exception):
        if isinstance(exc, SimulatedOutOfMemoryError) and not getattr(exc, "_located", False):
            where = user_line_in(exc.__traceback__)
            if where and exc.args:
                exc.args = (f"{exc.args[0].rstrip('.')}, at {where}.",) + tuple(exc.args[1:])
            exc._located = True  # type: ignore[attr-defined]
        if isinstance(exc, SimulationError) and not getattr(exc, "_located", False):
            where = user_line_in(exc.__traceback__)
            if where and not isinstance(exc, SimulationBudgetExceeded):
                try:
                    exc.args = (f"{where}: {exc.args[0]}",) + tuple(exc.args[1:])
                except Exception:
                    pass
            exc._located = True  # type: ignore[attr-defined]
        return exc
    if isinstance(exc, _priv.StageNotRun):
        new = StageWaits(f"{user_line_in(exc.__traceback__) or 'the cell'}: {exc}: run the job's "
                         "ranks together (--ranks all), so that each stage gets what the "
                         "stages before it send")
        new._located = True  # type: ignore[attr-defined]
        return new
    msg = str(exc)
    mesh = _MESH_TOO_BIG.search(msg) if world_size is not None else None
    if mesh is not None:  # the job's size is memmagic's option: say which to change
        exc.args = (f"{msg.rstrip('!. ')}: the mesh's sizes multiply to {mesh.group(2)} GPUs; "
                    f"run it with --world-size {mesh.group(2)}, or give init_device_mesh "
                    f"sizes that multiply to {world_size}",)
        return exc
    fake_error = isinstance(exc, (_priv.UnsupportedOperatorException, _priv.DataDependentOutputException,
                                  _priv.DynamicOutputShapeException))
    if not fake_error and (not any(s in msg for s in _SMELLS)
                           or any(s in msg for s in _CARD_TOO_OLD)):
        return exc
    where = user_line_in(exc.__traceback__) or "the cell"
    first = msg.strip().splitlines()[0] if msg.strip() else ""
    if isinstance(exc, _priv.DynamicOutputShapeException):
        why = "an op whose output size depends on tensor values (nonzero, boolean-mask indexing, unique)"
    elif isinstance(exc, _priv.UnsupportedOperatorException):
        why = f"an op with no simulated implementation (a custom or CUDA-only kernel: {first})"
    elif (sub := _SUBCLASS.search(msg)) is not None:
        why = (f"`{sub.group(1)}` is a tensor subclass made with _make_subclass in a way the "
               "simulation does not follow (bitsandbytes' 4-bit and 8-bit weights are "
               "simulated; this call passed options they do not): a library's own tensor "
               "type of that kind is not simulated")
    else:
        why = f"{type(exc).__name__}: {first}"
    hint = RERUN_HINT if world_size is None else _RANK_HINT.format(n=world_size)
    new = SimulationUnsupported(f"{where}: cannot be simulated: {why}; {hint}")
    new.__cause__ = exc
    new._located = True  # type: ignore[attr-defined]
    return new


