"""The simulated machine's devices, and the state one simulated run shares.

The simulated machine has one GPU, ``cuda:0``, and the host; every tensor of the
simulation is a fake *CPU* tensor, and which of the two a storage lives on is its
*pool* ("device" or "host"), kept by the tracker (:mod:`.tracker`). :func:`is_cuda_device`
is the one rule that names the devices; :class:`SimState` is what the function-level
rewriting (:mod:`.rewrite`) and the dispatch-level tracker share during a run.
"""

from __future__ import annotations

import linecache
import sys
import torch

from ...core import _torch_private as _priv
from ...core.failures import is_user_file
from ...core.tracking import StorageTracker
from ...report import Category
from .errors import SimulationUnsupported

__all__ = ["SimState", "is_cuda_device", "user_line", "CUDA0", "CPU", "META", "local_gpu",
           "set_local_gpu", "gpu_device"]

CUDA0 = torch.device("cuda", 0)
CPU = torch.device("cpu")
META = torch.device("meta")

_DEVICE_KINDS: dict[object, bool] = {}
# where simulated host storages' addresses start (the card's are the allocator model's,
# below 1 << 47): apart from each other and from the card's
_HOST_ADDRESSES = 1 << 56
_OTHER_OK = ("cpu", "meta")
# the index of the simulated GPU as the process sees it: 0, or a job's rank's own GPU on
# its node (LOCAL_RANK: ``torch.cuda.set_device(local_rank)``, ``f"cuda:{local_rank}"``)
_GPU_DEVICES = [CUDA0]  # the one simulated GPU as its tensors report it


def local_gpu() -> int:
    """The index the simulated GPU answers to besides 0 (a job's rank's LOCAL_RANK)."""
    return _GPU_DEVICES[0].index


def set_local_gpu(index: int) -> int:
    """Make the simulated GPU answer to ``index`` too; the index it answered to before (a
    job's rank puts it back when it ends)."""
    old = _GPU_DEVICES[0].index
    _GPU_DEVICES[0] = torch.device("cuda", int(index))
    return old


def gpu_device() -> torch.device:
    """The device the simulated GPU's tensors report: cuda:0, or a job's rank's own GPU."""
    return _GPU_DEVICES[0]


def is_cuda_device(dev: object) -> bool | None:
    """True for the simulated GPU (``'cuda'``, ``'cuda:0'``, ``torch.device('cuda')``,
    the index ``0``), False for the CPU or meta, None for "not a device". Raises
    :class:`SimulationUnsupported` for a device the simulation does not have (a second
    GPU, ``'mps'``, ``'xpu'``...), as a real machine with one CUDA GPU would fail there."""
    if isinstance(dev, bool) or not isinstance(dev, (torch.device, str, int)):
        return None
    try:
        return _DEVICE_KINDS[dev]
    except (KeyError, TypeError):
        pass
    if isinstance(dev, int):
        d = torch.device("cuda", dev) if dev >= 0 else None
    else:
        try:
            d = torch.device(dev)
        except (RuntimeError, ValueError):
            return None  # not a device string: torch raises its own error
    name = str(dev) if isinstance(dev, torch.device) else dev
    if d is not None and d.type == "cuda" and d.index == local_gpu() != 0:
        return True  # a job's rank's own GPU (not cached: the next run may be another rank)
    if d is None or (d.type == "cuda" and d.index not in (None, 0)):
        raise SimulationUnsupported(
            f"device {name!r} is not simulated: the simulated machine has one GPU, cuda:0; "
            "use device='cuda' (or 'cuda:0')")
    if d.type != "cuda" and d.type not in _OTHER_OK:
        raise SimulationUnsupported(
            f"device {name!r} is not simulated: the simulation models one CUDA GPU; use "
            "device='cuda' for the GPU or 'cpu' for the host")
    kind = d.type == "cuda"
    try:
        _DEVICE_KINDS[dev] = kind
    except TypeError:
        pass
    return kind


def user_line(frame) -> str | None:
    """'line N (`source`)' of the innermost frame of the user's code, from ``frame`` out."""
    while frame is not None:
        code = frame.f_code
        if is_user_file(code.co_filename):
            src = linecache.getline(code.co_filename, frame.f_lineno).strip()
            return f"line {frame.f_lineno}" + (f" (`{src}`)" if src else "")
        frame = frame.f_back
    return None


class SimState:
    """What the function mode and the dispatch mode share during one simulated run."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda                  # False: kernels="cpu", the simulated GPU is the CPU
        self.target: str | None = None    # pool forced for storages created right now
        self.pending = "host"             # pool of the storages the current op creates
        self.default_cuda = False         # torch.set_default_device("cuda") was called
        self.cuda_seen = False
        self.zero_read_serials: set[int] = set()  # storages whose reads are 0 (found_inf)
        self.pinned_serials: set[int] = set()  # host storages made page-locked (is_pinned)
        self.holding: str | None = None  # a check of values running: its bool reads hold
        self.data_reads = 0
        # (user line or None, what) -> reads: the report names lines, not internal reads
        self.read_ops: dict[tuple[str | None, str], int] = {}
        # every read of a tensor's values into Python (item, bool, tolist, numpy), real or
        # placeholder: code that reads none takes the same path whatever the values
        self.value_reads = 0
        self.tracker: StorageTracker | None = None  # the run's SimTracker (its pools)
        self.node_gpus = 1  # torch.cuda.device_count(): the node's GPUs (a job's rank: more)
        self.in_dispatch = 0              # >0 while torch's own dispatch code runs
        # torch.backends.cudnn.benchmark as the simulated cells left it (None: as the
        # process has it)
        self.cudnn_benchmark: bool | None = None
        # RNN stacks that ran on the device as cuDNN's (.cudnn_rnn): "LSTM", "GRU", "RNN" ->
        # calls, and "packed" -> those of them on packed sequences
        self.cudnn_rnn_calls: dict[str, int] = {}
        # and those left on the CPU kernels' memory (LSTM projections, cuDNN switched off):
        # "LSTM", "GRU", "RNN_TANH", "RNN_RELU" -> calls
        self.cpu_rnn_calls: dict[str, int] = {}
        # quantized-weight kernels that ran on the device: library -> op names
        self.library_kernels: dict[str, set[str]] = {}
        self.flex_attention_calls = 0     # flex_attention (and its backward) calls
        # how the cuDNN workspaces of this cell's convolution passes were sized -> passes
        self.cudnn_workspaces: dict[str, int] = {}
        self.cudnn_rnn_workspaces: dict[str, int] = {}  # the same for RNN calls

    def begin_run(self) -> None:
        """Per-cell counters back to zero (the state of a persistent simulated GPU lasts
        across cells: its default device and its tensors' pools stay)."""
        self.target = None
        self.pending = "host"
        self.cuda_seen = False
        self.data_reads = 0
        self.read_ops = {}
        self.value_reads = 0
        self.in_dispatch = 0
        self.cudnn_rnn_calls = {}
        self.cpu_rnn_calls = {}
        self.library_kernels = {}
        self.flex_attention_calls = 0
        self.cudnn_workspaces = {}
        self.cudnn_rnn_workspaces = {}

    def fake_device(self, t: torch.Tensor, real: torch.device) -> torch.device:
        """``FakeTensor.device`` during a run: the simulated GPU (cuda:0, or a job's rank's
        own GPU) for tensors on it, as seen by user and torch Python code; the real (CPU)
        device inside dispatch."""
        if self.in_dispatch or not self.cuda or real.type != "cpu":
            return real
        return _GPU_DEVICES[0] if self.pool_of(t) == "device" else real

    def device_of(self, t: torch.Tensor) -> torch.device:
        """The device user code sees for ``t``: the simulated GPU, else the CPU."""
        return _GPU_DEVICES[0] if self.cuda and self.pool_of(t) == "device" else CPU

    def refilled(self, t: torch.Tensor) -> None:
        """``t`` was given new contents in place (``param.data = ...``, a swap: how
        ``nn.Module.to``, ``.cuda()`` and ``to_empty`` move a parameter): a parameter's new
        storage is a parameter's, as its old one was, from now on (the breakdown at a peak
        that held both counts both as parameters)."""
        if isinstance(t, torch.nn.Parameter) and self.tracker is not None:
            self.tracker.note(t, Category.PARAMETERS)

    def note_read(self, what: str) -> None:
        """A read of values the simulation does not have, counted by the user's line."""
        self.data_reads += 1
        where = user_line(sys._getframe(1))
        key = (where, what)
        self.read_ops[key] = self.read_ops.get(key, 0) + 1

    def data_ptr(self, t: torch.Tensor) -> int | None:
        """What ``t.data_ptr()`` gives on a GPU: its storage's address (see
        :meth:`storage_ptr`) plus the view's offset; None where the run does not know it."""
        base = self.storage_ptr(t.untyped_storage())
        return base and base + t.storage_offset() * t.element_size()

    def storage_ptr(self, storage: torch.UntypedStorage) -> int | None:
        """What a storage's ``data_ptr()`` gives on a GPU, for a storage the run tracks:
        on the card, the address of its block in the allocator model; on the host, an
        address of its own (distinct storages never share one, as code that tells tensors
        apart by their pointer expects: a fake tensor's is 0). 0 for a storage of no
        bytes, as torch; None for a storage the run does not track."""
        tr = self.tracker
        entry = tr.storage_entry(storage) if tr is not None else None
        if entry is None:
            return None
        if storage.nbytes() == 0:
            return 0
        allocator = getattr(tr, "allocator", None)
        address = allocator.address_of(entry.serial) if entry.pool == "device" and allocator else None
        # host storages 4 GiB apart: a view never reaches the next
        return address if address is not None else _HOST_ADDRESSES + (entry.serial << 32)

    def pool_of(self, t: torch.Tensor) -> str:
        if not self.cuda:
            return "device"
        tr = self.tracker
        if tr is None:
            return "host"
        try:
            entry = tr.entry_of(t)
        except (RuntimeError, NotImplementedError, TypeError):
            entry = None
        if entry is None:  # torch.func's wrappers hold no storage: where the one inside is
            inner = _priv.functorch_unwrapped(t)
            return "host" if inner is t else self.pool_of(inner)
        return entry.pool
