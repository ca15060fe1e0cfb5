"""What a simulated run changes outside torch's kernels: third-party libraries and files.

Installed for one run and undone in ``finally`` (through :class:`.patching.Patches`):

* **transformers takes its eager path.** transformers counts a FakeTensor as tracing
  (``is_tracing`` calls ``transformers.utils.import_utils.is_fake_tensor``): with SDPA it
  then builds a (B, 1, T, T) mask and passes ``is_causal=False`` where a GPU run passes no
  mask and ``is_causal=True``. During the run ``is_fake_tensor`` answers False for the
  simulation's tensors, in the module that defines it and wherever it was imported by
  name, also when transformers is first imported inside the run. torch's own FakeTensor
  class is left alone (its meta kernels rely on it).
* **No fake data on disk.** ``torch.save`` of an object that holds simulated tensors
  writes nothing and adds a report note (``torch.save('ckpt.pt') skipped: ...``); a
  ``torch.load`` of what such a save would have written, in the same run, gives tensors
  of the same shapes, dtypes and devices (new allocations, as a load makes), for
  checkpoints made of dicts, lists, tuples, tensors and plain values. safetensors'
  ``save_file``/``save_model`` (``save_pretrained``) skip the same way, and its
  ``storage_ptr`` (and huggingface_hub's) tells simulated storages apart, so tied
  weights are found as on a GPU. Objects without simulated tensors are saved normally.
* **The card's size** comes from a default card when none is named, said in a note
  (:func:`.cuda_api.install_default_card_note`).
* **cuDNN attention's switch** (``torch.backends.cuda.enable_cudnn_sdp``) is put back.
* **torch.autograd.gradcheck and gradgradcheck are refused** with one line: they compare
  numerical and analytical gradients by value, and the simulation has none. So are
  **torch.nested's constructors**: a jagged batch's sizes are values (FakeTensorMode
  would stop on an internal assertion or a missing kernel).
* **torch.profiler is refused** with one line saying what to use instead: it would time
  the simulator's fake ops (seconds of Python per step), see no CUDA memory, and flood
  stderr with "CUDA used in profiler but not enabled".
* **Libraries' cached probes start and end fresh**: transformers (and accelerate,
  diffusers, peft) cache ``is_torch_cuda_available()``, ``is_torch_bf16_gpu_available()``
  and friends for the life of the process. Their caches are cleared when a run starts
  (a real cell's "no CUDA" must not steer the simulation onto the CPU path) and when it
  ends (the simulation's "CUDA, bf16" must not outlive it).
* **Libraries' Parameter subclasses** (bitsandbytes' 4-bit and 8-bit weights) are made
  over simulated tensors: ``torch.Tensor._make_subclass`` refuses a FakeTensor, so a
  stand-in that is both the library's class and a FakeTensor is made instead
  (:func:`.._torch_private.fake_as_subclass`); the library's own code then quantizes on
  ``.cuda()`` through its registered fake kernels, at the packed sizes a GPU holds.
* **transformers loads on the calling thread** (``HF_DEACTIVATE_ASYNC_LOAD``): its worker
  threads would run outside the simulation's modes, which are per thread.
* **nn.DataParallel on the one simulated GPU**: its scatter of the inputs to cuda:0 is a
  move to the simulated GPU (the CPU build has no ``torch._C._scatter``); with one
  device DataParallel then calls the module itself, as it does on a one-GPU machine.

Replacements stay correct if a reference to one outlives the run: outside a run each
calls the function it replaced.
"""

from __future__ import annotations

import copy
import importlib
import importlib.abc
import os
import pickle
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...core import _torch_private as _priv
from .cuda_api import install_default_card_note
from .errors import RERUN_HINT, SimulationUnsupported
from .gpus import CardSpec
from ...core.patching import Patches
from ...core.tracking import held_by

__all__ = ["install_compat", "holds_simulated_tensors"]

# top-level packages whose modules are scanned for names bound to a replaced function
_WATCHED = frozenset({"transformers", "safetensors", "huggingface_hub", "accelerate", "peft",
                      "diffusers", "timm", "bitsandbytes"})
# packages whose import must see this machine's torch.cuda, not the simulated one: with
# ``torch.cuda.is_available()`` True, bitsandbytes loads its CUDA backend, which calls into
# the CUDA runtime at import (and peft and transformers import it); its ops stay registered
# for every device, with fake-tensor kernels the simulation runs
_IMPORTED_AS_ON_THIS_MACHINE = frozenset({"bitsandbytes"})


# -- finding simulated tensors ---------------------------------------------------------------
class _Found(Exception):
    pass


class _NullFile:
    def write(self, data: bytes) -> int:
        return len(data)


def _none() -> None:
    return None


def _reaches_fake(t: torch.Tensor) -> bool:
    return _priv.is_fake(t) or any(map(_priv.is_fake, held_by(t) or ()))


def holds_simulated_tensors(obj: Any, pickle_module: Any = pickle) -> bool:
    """Whether pickling ``obj`` (as ``torch.save`` does) reaches a simulated (fake) tensor.

    Walks the object as ``pickle_module``'s Pickler would, writing nothing; real tensors
    and storages are not looked into. An object that cannot be pickled counts as holding
    none (``torch.save`` then raises its own error)."""
    base = getattr(pickle_module, "Pickler", pickle.Pickler)
    if not isinstance(base, type):
        base = pickle.Pickler

    class Probe(base):  # type: ignore[misc, valid-type]
        def reducer_override(self, o: Any):
            if isinstance(o, torch.Tensor):
                if _reaches_fake(o):
                    raise _Found
                return (_none, ())
            if isinstance(o, (torch.UntypedStorage, torch.storage.TypedStorage)):
                return (_none, ())
            return NotImplemented

    try:
        Probe(_NullFile(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except _Found:
        return True
    except Exception:
        return False
    return False


# -- what a skipped torch.save held, to answer a torch.load of it ------------------------------
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.Size, torch.layout, torch.memory_format)


@dataclass(frozen=True)
class _TensorSpec:
    storage: int
    nbytes: int
    offset: int
    size: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    parameter: bool


def _describe(obj: Any, memo: dict[int, Any]) -> Any:
    """A tree that rebuilds ``obj``'s shapes without its data: ("tensor", spec),
    ("dict", shell, [(key, node)]), ("list", [node]), ("tuple", type, [node]),
    ("atom", value), ("pickled", bytes) or ("missing", type name)."""
    key = id(obj)
    if key in memo:
        return memo[key]
    if isinstance(obj, torch.Tensor):
        if not _priv.is_fake(obj):
            node: Any = ("missing", type(obj).__name__)
        else:
            st = obj.untyped_storage()
            node = ("tensor", _TensorSpec(
                _priv.storage_key(st), st.nbytes(), obj.storage_offset(), tuple(obj.shape),
                tuple(obj.stride()), obj.dtype, obj.device, obj.requires_grad,
                isinstance(obj, torch.nn.Parameter)))
    elif isinstance(obj, _ATOMS):
        node = ("atom", obj)
    elif isinstance(obj, dict):
        shell = copy.copy(obj)
        shell.clear()
        node = ("dict", shell, [])
        memo[key] = node
        node[2].extend((k, _describe(v, memo)) for k, v in obj.items())
        return node
    elif isinstance(obj, list):
        node = ("list", [])
        memo[key] = node
        node[1].extend(_describe(v, memo) for v in obj)
        return node
    elif isinstance(obj, tuple):
        node = ("tuple", type(obj), [_describe(v, memo) for v in obj])
    elif holds_simulated_tensors(obj):
        node = ("missing", type(obj).__name__)
    else:
        try:
            node = ("pickled", pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:
            node = ("missing", type(obj).__name__)
    memo[key] = node
    return node


def _missing(node: Any, seen: set[int]) -> str | None:
    """The type name of the first part of the tree that cannot be rebuilt."""
    if id(node) in seen:
        return None
    seen.add(id(node))
    kind = node[0]
    if kind == "missing":
        return node[1]
    children = (v for _, v in node[2]) if kind == "dict" else node[1] if kind == "list" else (
        node[2] if kind == "tuple" else ())
    for child in children:
        found = _missing(child, seen)
        if found:
            return found
    return None


def _device_for(spec_device: torch.device, map_location: Any, name: str) -> torch.device:
    if map_location is None:
        return spec_device
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, dict):
        return torch.device(map_location.get(str(spec_device), str(spec_device)))
    raise SimulationUnsupported(
        f"torch.load({name}, map_location={type(map_location).__name__}) of a save the "
        f"simulation skipped cannot be simulated: give map_location as a device; {RERUN_HINT}")


def _rebuild(node: Any, map_location: Any, name: str, built: dict[int, Any],
             bases: dict[tuple, torch.Tensor]) -> Any:
    if id(node) in built:
        return built[id(node)]
    kind = node[0]
    if kind == "atom":
        return node[1]
    if kind == "pickled":
        return pickle.loads(node[1])
    if kind == "dict":
        out = copy.copy(node[1])
        built[id(node)] = out
        for k, v in node[2]:
            out[k] = _rebuild(v, map_location, name, built, bases)
        return out
    if kind == "list":
        out_list: list = []
        built[id(node)] = out_list
        out_list.extend(_rebuild(v, map_location, name, built, bases) for v in node[1])
        return out_list
    if kind == "tuple":
        items = [_rebuild(v, map_location, name, built, bases) for v in node[2]]
        cls = node[1]
        out_t = tuple(items) if cls is tuple else (
            cls._make(items) if hasattr(cls, "_make") else cls(items))
        built[id(node)] = out_t
        return out_t
    spec: _TensorSpec = node[1]
    device = _device_for(spec.device, map_location, name)
    itemsize = spec.dtype.itemsize
    base = bases.get((spec.storage, device))
    if base is None:  # one allocation per storage, as a load makes (views share it)
        base = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
        bases[(spec.storage, device)] = base
    if spec.nbytes % itemsize == 0:
        t = base.view(spec.dtype).as_strided(spec.size, spec.stride, spec.offset)
    else:
        t = torch.empty_strided(spec.size, spec.stride, dtype=spec.dtype, device=device)
    if spec.parameter:
        t = torch.nn.Parameter(t, requires_grad=spec.requires_grad)
    elif spec.requires_grad:
        t.requires_grad_(True)
    built[id(node)] = t
    return t


# -- the run -------------------------------------------------------------------------------------
def _label(f: Any) -> str:
    if isinstance(f, (str, bytes, os.PathLike)):
        return repr(os.fsdecode(f))
    name = getattr(f, "name", None)
    return repr(name) if isinstance(name, str) else f"<{type(f).__name__}>"


def _file_key(f: Any) -> Any:
    if isinstance(f, (str, bytes, os.PathLike)):
        return os.path.abspath(os.fsdecode(f))
    return ("file", id(f))


class _Skips:
    """One report note per kind of skipped write, naming what was skipped."""

    def __init__(self, notes: list[str]) -> None:
        self.notes = notes
        self.names: dict[str, list[str]] = {}
        self.where: dict[str, int] = {}

    def add(self, what: str, name: str, why: str) -> None:
        names = self.names.setdefault(what, [])
        names.append(name)
        if len(names) == 1:
            text = f"{what}({name}) skipped: {why}; nothing was written"
        else:
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            text = f"{what} skipped {len(names)} times ({shown}): {why}; nothing was written"
        i = self.where.get(what)
        if i is not None and i < len(self.notes) and self.notes[i].startswith(what):
            self.notes[i] = text
        else:
            self.where[what] = len(self.notes)
            self.notes.append(text)


class _Run:
    """State of one simulated run's adjustments. ``patches.call_on_restore(run.finish)``:
    when Patches reaches it, the run ends and its remaining bindings are undone."""

    def __init__(self, patches: Patches, notes: list[str], targets: tuple = ()) -> None:
        self.active = False
        self.patches = patches
        self.notes = notes
        self.skips = _Skips(notes)
        self.saved: dict[Any, tuple[Any, Any]] = {}  # a file object's key -> (tree, the file)
        self.loaded: list[str] = []
        self.paged = 0  # bytes of bitsandbytes' paged (unified-memory) tensors made
        self.paged_note = 0  # where in notes their note is
        self.replaced: dict[int, tuple[Any, Any]] = {}  # id(original) -> (original, replacement)
        self.originals: dict[int, Any] = {}  # id(replacement) -> original
        self.watch: _ImportWatch | None = None
        self.targets = _TARGETS + targets  # what is replaced, where its module is loaded

    # replacing functions
    def replace(self, module: Any, attr: str, make: Callable[[_Run, Any], Any]) -> None:
        """Replace ``module.attr`` (``attr`` may name a class's attribute: "Class.name")."""
        owner, _, attr = attr.rpartition(".")
        for name in filter(None, owner.split(".")):
            module = getattr(module, name, None)
        original = getattr(module, "__dict__", {}).get(attr)
        if original is None or id(original) in self.originals:
            return
        replacement = make(self, original)
        self.replaced[id(original)] = (original, replacement)
        self.originals[id(replacement)] = original
        self.patches.set(module, attr, replacement)

    def rebind(self, module: Any) -> None:
        """Point names in ``module`` that hold a replaced function at its replacement."""
        d = getattr(module, "__dict__", None)
        if not isinstance(d, dict):
            return
        for name, value in list(d.items()):
            hit = self.replaced.get(id(value))
            if hit is not None and hit[0] is value:
                self.patches.set(module, name, hit[1])

    def imported(self, module: Any) -> None:
        """A watched module was imported during the run."""
        if not self.active:
            return
        for mod_name, attr, make in self.targets:
            if module.__name__ == mod_name:
                self.replace(module, attr, make)

    def exec_as_on_this_machine(self, exec_module: Callable, module: Any) -> None:
        """Run a module's import with this machine's ``torch.cuda.is_available``."""
        simulated = torch.cuda.is_available
        torch.cuda.is_available = self.patches.original(torch.cuda, "is_available")
        try:
            exec_module(module)
        finally:
            torch.cuda.is_available = simulated

    def finish(self) -> None:
        """The run is over: stop watching imports, and put back what modules imported
        during the run bound by name."""
        if not self.active:
            return
        self.active = False
        watch = self.watch
        if watch is not None and watch in sys.meta_path:
            sys.meta_path.remove(watch)
        # modules imported during the run may have bound a replacement by name
        for mod in _watched_modules():
            d = mod.__dict__
            for name, value in list(d.items()):
                original = self.originals.get(id(value))
                if original is not None and self.replaced.get(id(original), (None, None))[1] is value:
                    try:
                        setattr(mod, name, original)
                    except Exception:
                        pass
        self.saved.clear()


def _watched_modules() -> list[Any]:
    return [m for n, m in list(sys.modules.items())
            if m is not None and n.partition(".")[0] in _WATCHED and hasattr(m, "__dict__")]


class _ImportWatch(importlib.abc.MetaPathFinder):
    """Lets the run adjust watched modules that are first imported inside it."""

    def __init__(self, run: _Run) -> None:
        self.run = run

    def find_spec(self, fullname: str, path: Any, target: Any = None):
        if not self.run.active or fullname.partition(".")[0] not in _WATCHED:
            return None
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run, exec_module = self.run, loader.exec_module

        def exec_and_adjust(module: Any) -> None:
            try:
                if fullname in _IMPORTED_AS_ON_THIS_MACHINE:
                    run.exec_as_on_this_machine(exec_module, module)
                else:
                    exec_module(module)
            finally:
                try:
                    del loader.exec_module
                except AttributeError:
                    pass
            run.imported(module)

        try:
            loader.exec_module = exec_and_adjust
        except (AttributeError, TypeError):
            pass
        return spec


# -- the replacements ----------------------------------------------------------------------------
def _is_fake_tensor(run: _Run, original: Callable) -> Callable:
    def is_fake_tensor(x: Any) -> bool:
        if run.active and _priv.is_fake(x):
            return False  # an eager GPU run's tensors are not fake
        return original(x)
    is_fake_tensor.__wrapped__ = original  # type: ignore[attr-defined]
    return is_fake_tensor


def _storage_ptr(run: _Run, original: Callable) -> Callable:
    def storage_ptr(tensor: torch.Tensor) -> Any:
        if run.active and _priv.is_fake(tensor):
            return _priv.storage_key(tensor.untyped_storage())  # unique per storage, nonzero
        return original(tensor)
    storage_ptr.__wrapped__ = original  # type: ignore[attr-defined]
    return storage_ptr


def _any_fake(tensors: Any) -> bool:
    values = tensors.values() if isinstance(tensors, dict) else ()
    return any(isinstance(t, torch.Tensor) and _reaches_fake(t) for t in values)


_NO_DATA = "the tensors are simulated (no data)"


def _save_file(run: _Run, original: Callable) -> Callable:
    def save_file(tensors: Any, filename: Any, *args: Any, **kwargs: Any):
        if run.active and _any_fake(tensors):
            run.skips.add("safetensors save_file", _label(filename), _NO_DATA)
            return None
        return original(tensors, filename, *args, **kwargs)
    save_file.__wrapped__ = original  # type: ignore[attr-defined]
    return save_file


def _save_model(run: _Run, original: Callable) -> Callable:
    def save_model(model: Any, filename: Any, *args: Any, **kwargs: Any):
        if run.active and isinstance(model, torch.nn.Module) and _any_fake(model.state_dict()):
            run.skips.add("safetensors save_model", _label(filename), _NO_DATA)
            return None
        return original(model, filename, *args, **kwargs)
    save_model.__wrapped__ = original  # type: ignore[attr-defined]
    return save_model


def _safetensors_save(run: _Run, original: Callable) -> Callable:
    def save(tensors: Any, *args: Any, **kwargs: Any):
        if run.active and _any_fake(tensors):
            raise SimulationUnsupported(
                "safetensors.torch.save() cannot return the bytes of simulated tensors (they "
                f"have no data); save_file() is skipped in a simulation instead; {RERUN_HINT}")
        return original(tensors, *args, **kwargs)
    save.__wrapped__ = original  # type: ignore[attr-defined]
    return save


# what simulated cells' torch.save left at each path: the simulated disk lasts as the real
# one does (a path maps to the shapes of what was saved, a few hundred bytes a tensor)
_SAVED_FILES: dict[str, tuple[Any, Any, float]] = {}


def _saved_file(key: str) -> tuple[Any, Any] | None:
    """(tree, file) of what a simulated torch.save left at path ``key``; None when there is
    none, or when the real file was written since (a real cell's save wins)."""
    entry = _SAVED_FILES.get(key)
    if entry is None:
        return None
    tree, f, when = entry
    try:
        newer = os.path.getmtime(key) > when
    except OSError:
        newer = False
    if newer:
        del _SAVED_FILES[key]
        return None
    return tree, f


def _torch_save(run: _Run, original: Callable) -> Callable:
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any):
        if run.active:
            pickle_module = kwargs.get("pickle_module", args[0] if args else pickle)
            if holds_simulated_tensors(obj, pickle_module):
                run.skips.add("torch.save", _label(f), "the object holds simulated tensors (no data)")
                try:
                    tree = _describe(obj, {})
                except Exception:  # a container that cannot be copied empty: load says so
                    tree = ("missing", type(obj).__name__)
                key = _file_key(f)
                if isinstance(key, str):  # a path: a later cell's torch.load finds it too
                    _SAVED_FILES[key] = (tree, f, time.time())
                else:  # a file object: this run's
                    run.saved[key] = (tree, f)
                return None
        return original(obj, f, *args, **kwargs)
    save.__wrapped__ = original  # type: ignore[attr-defined]
    return save


def _torch_load(run: _Run, original: Callable) -> Callable:
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any):
        if run.active and not isinstance(f, int):
            key = _file_key(f)
            hit = _saved_file(key) if isinstance(key, str) else run.saved.get(key)
            if hit is not None:
                name = _label(f)
                missing = _missing(hit[0], set())
                if missing:
                    raise SimulationUnsupported(
                        f"torch.load({name}): the simulation skipped the torch.save that made it "
                        f"(simulated tensors have no data) and cannot rebuild a {missing} from it; "
                        f"save a state_dict() instead, or {RERUN_HINT}")
                out = _rebuild(hit[0], map_location, name, {}, {})
                if name not in run.loaded:
                    run.loaded.append(name)
                    run.notes.append(f"torch.load({name}) gave simulated tensors like those its "
                                     "skipped torch.save held (nothing was read)")
                return out
        return original(f, map_location, *args, **kwargs)
    load.__wrapped__ = original  # type: ignore[attr-defined]
    return load


_PAGED_NOTE = ("paged optimizer state ({}) is CUDA unified memory that bitsandbytes allocates "
               "outside PyTorch's allocator: it is not in memory_allocated(), a GPU moves it to "
               "host RAM when the card fills, so it is counted on the host here, not on the card")


def _get_paged(run: _Run, original: Callable) -> Callable:
    def get_paged(*shape: int, dtype: torch.dtype = torch.float32, device: Any = None):
        if not run.active:
            return original(*shape, dtype=dtype, **({} if device is None else {"device": device}))
        out = torch.empty(*shape, dtype=dtype)  # the host pool: see _PAGED_NOTE
        out.is_paged = True
        out.page_deviceid = 0
        from ...report import format_bytes

        if not run.paged:
            run.paged_note = len(run.notes)
            run.notes.append("")
        run.paged += out.nbytes
        run.notes[run.paged_note] = _PAGED_NOTE.format(format_bytes(run.paged))
        return out
    return get_paged


def _fill(run: _Run, original: Callable) -> Callable:
    def fill(A: torch.Tensor, value: Any, device: Any = None, prefetch: bool = True) -> None:
        if not (run.active and getattr(A, "is_paged", False)):
            return original(A, value, device, prefetch)
        A.fill_(value)  # bitsandbytes' C kernel writes the unified memory
    return fill


def _prefetch_tensor(run: _Run, original: Callable) -> Callable:
    def prefetch_tensor(A: torch.Tensor, to_cpu: bool = False) -> None:
        if not run.active:
            return original(A, to_cpu)
        return None  # moving unified-memory pages: no memory of PyTorch's changes
    return prefetch_tensor


# (module, attribute, replacement factory): applied when the module is loaded
_TARGETS: tuple[tuple[str, str, Callable[[_Run, Any], Any]], ...] = (
    ("transformers.utils.import_utils", "is_fake_tensor", _is_fake_tensor),
    ("safetensors.torch", "storage_ptr", _storage_ptr),
    ("safetensors.torch", "save_file", _save_file),
    ("safetensors.torch", "save_model", _save_model),
    ("safetensors.torch", "save", _safetensors_save),
    ("huggingface_hub.serialization._torch", "storage_ptr", _storage_ptr),
    ("bitsandbytes.functional", "get_paged", _get_paged),
    ("bitsandbytes.functional", "prefetch_tensor", _prefetch_tensor),
    ("bitsandbytes.functional", "fill", _fill),
)


class _CudnnSDPSwitch:
    """``torch.backends.cuda``'s cuDNN attention switch as an attribute, so that Patches
    puts back what a cell set with ``enable_cudnn_sdp`` (the flash, memory-efficient and
    math switches are restored with the backend's other globals)."""

    __slots__ = ()

    @property
    def enabled(self) -> bool:
        return torch.backends.cuda.cudnn_sdp_enabled()

    @enabled.setter
    def enabled(self, value: bool) -> None:
        torch.backends.cuda.enable_cudnn_sdp(bool(value))


PROFILER_REFUSED = (
    "torch.profiler cannot profile a simulated GPU (it would time the simulator's fake ops "
    "and see no CUDA memory): for the simulated GPU's memory op by op use %%gpumem "
    "--timeline or report.trace; for the profiler's own memory columns run the cell with "
    "--backend cpu, or on a GPU")


def _refuse_profiler(*args: Any, **kwargs: Any) -> Any:
    raise SimulationUnsupported(PROFILER_REFUSED)


GRADCHECK_REFUSED = (
    "torch.autograd.gradcheck and gradgradcheck compare gradients by their values, which a "
    f"simulation does not have; {RERUN_HINT}")


def _refuse_gradcheck(*args: Any, **kwargs: Any) -> Any:
    raise SimulationUnsupported(GRADCHECK_REFUSED)


NESTED_REFUSED = (
    "nested tensors (torch.nested) cannot be simulated: their ragged sizes are values a "
    "simulation does not have (fake tensors hold a batch of shapes only as symbolic "
    f"sizes); pad the batch to one length, or {RERUN_HINT}")
# torch.nested's functions that make a nested tensor
_NESTED_MAKERS = ("as_nested_tensor", "nested_tensor", "nested_tensor_from_jagged", "narrow",
                  "masked_select")


def _refuse_nested(name: str) -> Callable:
    """A stand-in for ``torch.nested.<name>`` (one per name: dynamo maps each of torch's
    functions to one object)."""
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise SimulationUnsupported(NESTED_REFUSED)

    refused.__name__ = refused.__qualname__ = name
    return refused


def _one_gpu_scatter(original: Callable) -> Callable:
    """``torch.nn.parallel.comm.scatter`` onto the one simulated GPU: the whole tensor,
    moved there (what ``_scatter`` does with one device: a copy when it is elsewhere)."""
    def scatter(tensor, devices=None, chunk_sizes=None, dim=0, streams=None, *, out=None):
        devs = [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)
                for d in (devices or ())]
        if out is None and len(devs) == 1 and devs[0].type == "cuda" and devs[0].index in (None, 0):
            return (tensor.to("cuda"),)
        return original(tensor, devices, chunk_sizes, dim, streams, out=out)
    return scatter


# modules whose lru_cached is_*() probes answer from torch.cuda (what the run changes)
_CACHED_PROBE_MODULES = ("transformers.utils.import_utils", "accelerate.utils.imports",
                         "diffusers.utils.import_utils", "peft.import_utils")


def clear_probe_caches() -> None:
    """Empty the caches of the libraries' ``is_*`` probes that are loaded (they answer
    anew on their next call)."""
    for name in _CACHED_PROBE_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        for attr, value in list(vars(module).items()):
            clear = getattr(value, "cache_clear", None)
            if attr.startswith("is_") and callable(clear):
                clear()


def _parameter_subclasses(patches: Patches) -> None:
    """A library's Parameter subclass over a simulated tensor (bitsandbytes' ``Params4bit``,
    ``Int8Params``): torch's ``_make_subclass`` refuses a FakeTensor, the stand-in of
    :func:`.._torch_private.fake_as_subclass` is made instead, with the library's methods
    (quantizing on ``.cuda()``) and attributes (the quantization state)."""
    cls, attr = _priv.make_subclass_slot()
    original = patches.original(cls, attr)

    def _make_subclass(cls, data, requires_grad=False, **kwargs):  # torch's signature
        if (_priv.is_fake(data) and not kwargs and isinstance(cls, type)
                and not issubclass(cls, _priv.FakeTensor)):
            return _priv.fake_as_subclass(cls, data, requires_grad)
        return original(cls, data, requires_grad, **kwargs)

    patches.set(cls, attr, staticmethod(_make_subclass))


def _forget_simulated_code_maps() -> None:
    """bitsandbytes caches its 8-bit code map in a module dict on the device of the first
    tensor it quantizes: one made on the simulated GPU is dropped when the run ends, so that a
    real run after it makes its own (a simulated run makes it again, 1 KiB)."""
    qmap = getattr(sys.modules.get("bitsandbytes.functional"), "name2qmap", None)
    if isinstance(qmap, dict):
        for key in [k for k, v in qmap.items() if _priv.is_fake(v)]:
            del qmap[key]


def install_compat(patches: Patches, notes: list[str], target: CardSpec | None = None,
                   targets: tuple = ()) -> None:
    """Install the adjustments for one simulated run (see the module's docstring); every
    one is undone by ``patches.restore()``. ``notes`` is the report's list of notes;
    ``target`` the named card (None: size queries answer for a default card, noted);
    ``targets``: more (module, attribute, replacement factory) to replace for this run."""
    clear_probe_caches()
    patches.call_on_restore(clear_probe_caches)  # runs after everything installed below
    run = _Run(patches, notes, tuple(targets))
    run.active = True
    patches.call_on_restore(run.finish)  # undone last: what the run bound by name
    switch = _CudnnSDPSwitch()
    patches.set(switch, "enabled", switch.enabled)
    if target is None:
        install_default_card_note(patches, notes)
    import torch.serialization as serialization

    save, load = _torch_save(run, torch.save), _torch_load(run, torch.load)
    for mod, attr, value in ((torch, "save", save), (serialization, "save", save),
                             (torch, "load", load), (serialization, "load", load)):
        original = mod.__dict__.get(attr)
        run.replaced.setdefault(id(original), (original, value))
        run.originals[id(value)] = original
        patches.set(mod, attr, value)
    for cls, attr in _priv.profiler_entry_slots():
        patches.set(cls, attr, _refuse_profiler)
    # torch.autograd.gradcheck is the function; its module is shadowed by it
    for mod in (torch.autograd, importlib.import_module("torch.autograd.gradcheck")):
        for attr in ("gradcheck", "gradgradcheck"):
            patches.set(mod, attr, _refuse_gradcheck)
    for attr in _NESTED_MAKERS:
        if hasattr(torch.nested, attr):
            patches.set(torch.nested, attr, _refuse_nested(attr))
    _parameter_subclasses(patches)
    patches.call_on_restore(_forget_simulated_code_maps)
    # transformers' from_pretrained copies weights to the device on worker threads, where the
    # simulation's modes (per thread) are not: it loads on the calling thread when told so
    patches.set_item(os.environ, "HF_DEACTIVATE_ASYNC_LOAD", "1")
    import torch.nn.parallel.comm as comm

    patches.set(comm, "scatter", _one_gpu_scatter(comm.scatter))
    cache = _priv.data_parallel_stream_cache()
    if cache is not None:  # the streams it caches in the run are not kept past it
        patches.set(cache[0], cache[1], getattr(*cache))
    for mod_name, attr, make in run.targets:
        module = sys.modules.get(mod_name)
        if module is not None:
            run.replace(module, attr, make)
    for module in _watched_modules():
        run.rebind(module)
    run.watch = _ImportWatch(run)
    sys.meta_path.insert(0, run.watch)
