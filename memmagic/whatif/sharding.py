"""Memory per GPU when a cell's model is sharded with FSDP2 over N GPUs, simulated.

The cell runs on the simulated GPU as rank 0 of a fake process group of N ranks (torch's
"fake" backend: collectives return at once, no GPUs, no network). When the cell builds an
optimizer, the modules that own its parameters are sharded first with FSDP2's
``fully_shard`` (each element of a ``ModuleList`` -- transformer blocks, stages -- then the
root), as a training script would do before making its optimizer; the optimizer then
gets the sharded parameters. The report is rank 0's: its shards of parameters, gradients
and optimizer state, the parameters FSDP2 all-gathers around each block's forward and
backward, the reduce-scatter buffers, and the cell's activations for the batch the cell
uses (each rank trains on a batch of that size). Nothing is divided by N by hand.

Knows nothing of IPython.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence
import types
import warnings
import weakref

from ..core.failures import is_out_of_memory
from ..core.patching import output_captured
from ..report import MemoryReport, format_bytes
from ..core import _torch_private as _priv
from ..backends.sim import rank_of

__all__ = ["ShardResult", "simulate_fsdp", "simulate_tp", "simulate_zero", "shard_memory",
           "ShardingUnsupported", "WORLD_SIZES", "STYLES", "rank_of", "tp_plan", "parallelize"]

WORLD_SIZES = (2, 4, 8)


class ShardingUnsupported(RuntimeError):
    """The cell cannot be simulated under FSDP2; the message says why."""


@dataclass(frozen=True)
class ShardResult:
    """Rank 0's memory with the cell's model sharded over ``world_size`` GPUs. Bytes.

    ``report`` is the simulated run's report (None when it could not run: ``reason`` says
    why). ``sharded`` names the modules ``fully_shard`` was applied to."""

    world_size: int
    report: MemoryReport | None
    sharded: tuple[str, ...] = ()
    reason: str | None = None
    style: str = "fsdp"  # "tp": tensor parallel by the model's own plan; "zero1", "zero2"

    @property
    def peak(self) -> int | None:
        """Peak live bytes per GPU (rank 0), None when the run failed."""
        return None if self.report is None else self.report.peak

    @property
    def reserved_peak(self) -> int | None:
        """What must fit on each GPU (:attr:`MemoryReport.need`), None when the run failed."""
        return None if self.report is None else self.report.need

    @property
    def fits(self) -> bool | None:
        return None if self.report is None else self.report.fits

    def label(self) -> str:
        return STYLES[self.style].format(n=self.world_size)

    def __str__(self) -> str:
        if self.report is None:
            return f"{self.label()}: not simulated: {self.reason}"
        return f"{self.label()}: {format_bytes(self.peak)} per GPU"


# The ways a model is split over GPUs, and their rows' labels. ZeRO-3 is FSDP2's default
# ("fsdp"); ZeRO-2 is FSDP2 keeping the gathered parameters from forward to backward (FSDP1's
# SHARD_GRAD_OP), ZeRO-1 torch's ZeroRedundancyOptimizer (optimizer state only).
STYLES = {"fsdp": "shard over {n} GPUs (FSDP2)",
          "tp": "tensor parallel over {n} GPUs (the model's TP plan)",
          "zero2": "ZeRO-2 over {n} GPUs (grads, optimizer state)",
          "zero1": "ZeRO-1 over {n} GPUs (optimizer state)"}
_WHAT = {"fsdp": "FSDP2", "tp": "tensor parallelism", "zero2": "ZeRO-2", "zero1": "ZeRO-1"}


# -- sharding the cell's model when it makes its optimizer -----------------------------------
class _AutoShard:
    """Applies ``fully_shard`` (``style`` "fsdp": each ModuleList block, then the root;
    "zero2": the same, the gathered parameters kept from forward to backward) or the
    model's own tensor-parallel plan ("tp": :func:`parallelize`) to the modules owning an
    optimizer's parameters when the optimizer is made (``Optimizer.__init__``), and hands it
    the sharded parameters. "zero1" leaves the model whole and makes the optimizer step
    through torch's ZeroRedundancyOptimizer (:meth:`shard_state`)."""

    def __init__(self, mesh: Any, namespace: Mapping[str, Any], style: str = "fsdp") -> None:
        self.mesh = mesh
        self.namespace = namespace
        self.style = style
        self.modules: list[weakref.ref] = []  # made during the run, in order
        self.children: set[int] = set()
        self.sharded: list[str] = []
        self.done: set[int] = set()
        self.errors: list[BaseException] = []
        self.making_own = False  # the optimizers ZeroRedundancyOptimizer makes are its own

    @contextmanager
    def installed(self) -> Iterator["_AutoShard"]:
        import torch
        import torch.nn.modules.module as module_mod

        seen: set[int] = set()

        def saw(module) -> None:
            if id(module) not in seen:
                seen.add(id(module))
                self.modules.append(weakref.ref(module))

        def on_param(module, name, param):
            saw(module)

        def on_child(module, name, child):
            saw(module)
            if child is not None:
                self.children.add(id(child))
                saw(child)

        opt_cls = torch.optim.Optimizer
        original_init = opt_cls.__init__
        auto = self

        def __init__(opt, params, defaults):
            if auto.making_own:
                return original_init(opt, params, defaults)
            if auto.style != "zero1":
                return original_init(opt, auto.shard_for(params), defaults)
            original_init(opt, params, defaults)
            auto.shard_state(opt)

        handles = []
        try:
            handles.append(module_mod.register_module_parameter_registration_hook(on_param))
            handles.append(module_mod.register_module_module_registration_hook(on_child))
            opt_cls.__init__ = __init__
            yield self
        finally:
            opt_cls.__init__ = original_init
            for h in handles:
                h.remove()

    def _roots(self) -> list[tuple[str, Any]]:
        import torch

        out: list[tuple[str, Any]] = []
        ids: set[int] = set()
        for name, value in list(self.namespace.items()):
            if isinstance(value, torch.nn.Module) and id(value) not in ids:
                out.append((name, value))
                ids.add(id(value))
        for ref in self.modules:
            m = ref()
            if m is not None and id(m) not in self.children and id(m) not in ids:
                out.append((type(m).__name__, m))
                ids.add(id(m))
        return out

    def shard_for(self, params: Any) -> Any:
        """``params`` as given to an optimizer, with the parameters of modules just sharded
        replaced by their sharded versions."""
        import torch

        items = list(params)
        groups = [g for g in items if isinstance(g, dict)]
        flat = [p for g in groups for p in g["params"]] if groups else items
        wanted = {id(p) for p in flat if isinstance(p, torch.Tensor)}
        replace: dict[int, Any] = {}
        for name, root in self._roots():
            if id(root) in self.done:
                continue
            owned = [(m, n, p) for m in root.modules() for n, p in _priv.own_parameters(m).items()
                     if p is not None]
            if not any(id(p) in wanted for _, _, p in owned):
                continue
            try:
                self._shard(name, root)
            except Exception as exc:  # noqa: BLE001 - the row says why, in one line
                if is_out_of_memory(exc) or isinstance(exc, ShardingUnsupported):
                    raise
                raise ShardingUnsupported(f"{_WHAT[self.style]} could not split {name}: "
                                          f"{type(exc).__name__}: {exc}") from exc
            self.done.add(id(root))
            for m, n, p in owned:
                new = _priv.own_parameters(m).get(n)
                if new is not None and new is not p:
                    replace[id(p)] = new
        if not replace:
            return items

        def swap(ps):
            return [replace.get(id(p), p) for p in ps]

        if groups:
            return [{**g, "params": swap(list(g["params"]))} for g in items]
        return swap(items)

    def shard_state(self, opt: Any) -> None:
        """ZeRO-1 for ``opt``: torch's ZeroRedundancyOptimizer over its parameter groups
        makes the optimizer of this rank's partition, and ``opt`` steps through it. ``opt``
        keeps every parameter (``zero_grad``, a GradScaler's unscaling and LR schedulers see
        them all); its state is the partition's."""
        with warnings.catch_warnings():  # importing it scripts torch's functional optimizers
            warnings.simplefilter("ignore", DeprecationWarning)
            from torch.distributed.optim import ZeroRedundancyOptimizer

        groups = [{k: v for k, v in g.items()} for g in opt.param_groups]
        self.making_own = True
        try:
            zero = ZeroRedundancyOptimizer(groups, optimizer_class=type(opt),
                                           **_taken(type(opt), opt.defaults))
        finally:
            self.making_own = False
        zero.param_groups = opt.param_groups  # a scheduler's learning rates reach the step

        def step(self, *args, **kwargs):  # a method of ``opt``: LR schedulers re-bind it
            return zero.step(*args, **kwargs)

        opt.step = types.MethodType(step, opt)
        opt.state = zero.optim.state
        self.sharded.append(type(opt).__name__)

    def _shard(self, name: str, root: Any) -> None:
        import torch
        from torch.distributed.fsdp import fully_shard

        if self.style == "tp":
            parallelize(root, self.mesh)
            self.sharded.append(name)
            return

        blocks: list[tuple[str, Any]] = []
        taken: set[int] = set()
        for path, m in root.named_modules():
            if isinstance(m, torch.nn.ModuleList):
                for i, child in enumerate(m):
                    if id(child) in taken or not any(True for _ in child.parameters()):
                        continue
                    if any(id(a) in taken for a in _ancestors(root, child)):
                        continue
                    blocks.append((f"{name}.{path}.{i}" if path else f"{name}.{i}", child))
                    taken.add(id(child))
        keep = self.style == "zero2"  # gathered from forward to backward
        for label, block in blocks:
            fully_shard(block, mesh=self.mesh, reshard_after_forward=not keep)
            self.sharded.append(label)
        fully_shard(root, mesh=self.mesh, reshard_after_forward=not keep)
        self.sharded.append(name)


def _taken(cls: type, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of an optimizer's ``defaults`` its class's constructor takes (AdamW's
    defaults name ``decoupled_weight_decay``, which it sets itself)."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def _tp_styles() -> dict[str, Callable[[], Any]]:
    """transformers' tensor-parallel styles (``model.tp_plan``'s values) -> makers of
    torch's ParallelStyles."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
            "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
            "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}


def tp_plan(model: Any) -> dict[str, Any]:
    """The tensor-parallel plan a transformers model carries (``model.tp_plan``: module
    paths with ``*`` for a layer index -> "colwise", "rowwise"...), as torch's
    ``parallelize_module`` takes it. Raises ShardingUnsupported for a model without one, or
    a style that is not simulated."""
    plan = getattr(model, "tp_plan", None)
    if not isinstance(plan, Mapping) or not plan:
        raise ShardingUnsupported(
            f"{type(model).__name__} carries no tensor-parallel plan (transformers models "
            "do: model.tp_plan); parallelize it in the cell with %%gpumem --world-size N")
    styles = _tp_styles()
    unknown = sorted({v for v in plan.values() if v not in styles})
    if unknown:
        raise ShardingUnsupported(f"the model's TP plan uses {', '.join(unknown)}, not simulated "
                                  f"(simulated: {', '.join(styles)})")
    return {path: styles[style]() for path, style in plan.items()}


def parallelize(model: Any, mesh: Any) -> Any:
    """Tensor parallelism for a transformers model by its own plan (:func:`tp_plan`), with
    torch's ``parallelize_module`` on ``mesh`` (a 1-D mesh, or one dimension of a 2-D
    one); the parameters the plan leaves (norms) replicated, so that one optimizer takes
    them all. Returns ``model``."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(_plan_owner(model), mesh, tp_plan(model))
    _replicate_the_rest(model, mesh)
    return model


def _plan_owner(model: Any) -> Any:
    """The module whose paths the model's TP plan names: the model itself, or the model a
    wrapper forwards ``tp_plan`` to (peft's PeftModel: its base model's plan, with the base
    model's paths)."""
    for m in model.modules():
        if any("tp_plan" in vars(c) for c in type(m).__mro__):
            return m
    return model


def _replicate_the_rest(root: Any, mesh: Any) -> None:
    """The modules whose parameters a TP plan leaves (norms): their parameters replicated
    on every rank as DTensors (a foreach optimizer takes no mix of DTensors and plain
    tensors), their inputs made replicated DTensors and their outputs local again, as
    transformers' and torchtitan's replicated styles do."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def inputs(module, args, mesh):
        return tuple(DTensor.from_local(a, mesh, [Replicate()])
                     if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a
                     for a in args)

    def outputs(module, out, mesh):
        return out.to_local() if isinstance(out, DTensor) else out

    for m in list(root.modules()):
        own = [p for p in _priv.own_parameters(m).values() if p is not None]
        if own and not any(isinstance(p, DTensor) for p in own):
            distribute_module(m, mesh, input_fn=inputs, output_fn=outputs)


def _ancestors(root: Any, module: Any) -> list[Any]:
    """The modules between ``root`` and ``module`` (exclusive), outermost first."""
    path: list[Any] = []

    def walk(m, trail) -> bool:
        for child in m.children():
            if child is module:
                path.extend(trail)
                return True
            if walk(child, trail + [child]):
                return True
        return False

    walk(root, [])
    return path


# -- the runs -----------------------------------------------------------------------------------
RunFn = Callable[[dict], Any]


def _as_run(cell: str | RunFn) -> RunFn:
    if callable(cell):
        return cell
    if not isinstance(cell, str):
        raise TypeError(f"cell must be source text or a function of the namespace, not {type(cell).__name__}")
    code = compile(cell, "<cell>", "exec")

    def run(ns: dict) -> None:
        exec(code, ns)

    return run


def _shard_existing(auto: _AutoShard, ns: dict) -> None:
    """Shard the models whose parameters optimizers of ``ns`` (made in earlier cells)
    hold, as a training script shards before it makes its optimizer: each optimizer then
    holds the sharded parameters; its state and the gradients (of the whole parameters)
    start again (FSDP2 keeps shards of them, made at the next backward and step)."""
    import torch

    seen: set[int] = set()
    for value in list(ns.values()):
        if not isinstance(value, torch.optim.Optimizer) or id(value) in seen:
            continue
        seen.add(id(value))
        params = [p for g in value.param_groups for p in g["params"]]
        for p in params:  # gradients of the whole parameters (a step of an earlier cell)
            p.grad = None
        if auto.style == "zero1":  # the model stays whole; the state is this rank's part
            value.state.clear()
            auto.shard_state(value)
            continue
        swap = {id(p): q for p, q in zip(params, auto.shard_for(params)) if q is not p}
        if not swap:
            continue
        for g in value.param_groups:
            g["params"] = [swap.get(id(p), p) for p in g["params"]]
        value.state.clear()


def _notebook_run(backend_cls: Any, session: Any, gpu: Any, gpu_memory: Any, auto: _AutoShard,
                  run: RunFn, ns: dict) -> Any:
    """The cell on a copy of the notebook's simulated GPU (``session``): a first run shards
    the models of its optimizers (:func:`_shard_existing`), the cell then runs on what that
    left, from an emptied cache (rank 0 of a job that never held the whole model)."""
    from ..backends.sim import SimSession

    work = SimSession()
    work.card, _notes = session.card.copy()
    if gpu is None and gpu_memory is None:
        gpu = work.card.target  # no card named: the notebook's
    try:
        backend = backend_cls(gpu=gpu, gpu_memory=gpu_memory, session=work)
        first = backend.execute(lambda n: _shard_existing(auto, n), ns)
        if first.error is not None:
            return first
        allocator = work.card.tracker.allocator
        if allocator is not None:
            allocator.empty_cache()
        return backend.execute(run, ns)
    finally:
        work.reset()


def simulate_fsdp(cell: str | RunFn, namespace: Mapping[str, Any] | None = None, *,
                  world_size: int, gpu: Any = None, gpu_memory: int | str | None = None,
                  session: Any = None) -> ShardResult:
    """Run ``cell`` (source text, or a function of the namespace) on a simulated GPU as
    rank 0 of ``world_size`` ranks, its model sharded with FSDP2 when it makes its
    optimizer. ``namespace`` is copied (the cell's names do not land in it). Returns the
    :class:`ShardResult`; one whose ``report`` is None says why it could not run.

    Where names of ``namespace`` hold objects of the notebook's simulated GPU (a model and
    optimizer built in earlier simulated cells; ``session``, by default the one they live
    on), the run starts from a copy of that GPU, left as it was: the models its
    optimizers hold are sharded first, then the cell runs."""
    return _simulate(cell, namespace, world_size, "fsdp", gpu, gpu_memory, session)


def simulate_tp(cell: str | RunFn, namespace: Mapping[str, Any] | None = None, *,
                world_size: int, gpu: Any = None, gpu_memory: int | str | None = None,
                session: Any = None) -> ShardResult:
    """:func:`simulate_fsdp` with tensor parallelism instead: the cell's model is
    parallelized by its own plan (a transformers model's ``tp_plan``: attention and MLP
    projections split by columns and rows, the embedding by rows) with torch's
    ``parallelize_module`` when it makes its optimizer. A model without a plan gets a
    ShardResult whose reason says so."""
    return _simulate(cell, namespace, world_size, "tp", gpu, gpu_memory, session)


def _simulate(cell: str | RunFn, namespace: Mapping[str, Any] | None, world_size: int,
              style: str, gpu: Any, gpu_memory: Any, session: Any) -> ShardResult:
    from ..core import _torch_private as dist_priv
    from ..backends.sim import SimBackend, SimulationUnsupported, session_of

    world_size = int(world_size)
    if world_size < 2:
        raise ValueError(f"world_size must be 2 or more (1 GPU is the plain run), not {world_size}")
    what = _WHAT[style]
    run = _as_run(cell)
    ns = dict(namespace or {})
    if session is None:
        session = session_of(ns)
    elif not session.holds(ns):
        session = None
    try:
        with ExitStack() as stack:
            stack.enter_context(output_captured())  # the re-run's prints are not the user's
            stack.enter_context(rank_of(world_size))
            auto = _AutoShard(dist_priv.device_mesh("cuda", world_size), ns, style)
            stack.enter_context(auto.installed())
            if session is not None:
                outcome = _notebook_run(SimBackend, session, gpu, gpu_memory, auto, run, ns)
            else:
                outcome = SimBackend(gpu=gpu, gpu_memory=gpu_memory).execute(run, ns)
    except SimulationUnsupported as exc:  # the notebook's objects do not fit that card
        return ShardResult(world_size, None, reason=str(exc), style=style)
    except RuntimeError as exc:  # a process group exists already
        return ShardResult(world_size, None, reason=str(exc), style=style)
    error = outcome.error
    report = outcome.report
    if isinstance(error, ShardingUnsupported):  # the model has no plan this can follow
        return ShardResult(world_size, None, reason=str(error), style=style)
    if not auto.sharded:
        why = (f"the cell made no optimizer over a model's parameters: {what} splits a model "
               "before its optimizer is made, so simulate the cell that builds both")
        if error is not None:
            why = f"the cell failed before sharding: {report.error}"
        return ShardResult(world_size, None, reason=why, style=style)
    if error is not None and not is_out_of_memory(error):
        return ShardResult(world_size, None, tuple(auto.sharded),
                           reason=f"{what} could not run this model in the simulation: {report.error}",
                           style=style)
    return ShardResult(world_size, report, tuple(auto.sharded), style=style)


def simulate_zero(cell: str | RunFn, namespace: Mapping[str, Any] | None = None, *,
                  world_size: int, stage: int, gpu: Any = None,
                  gpu_memory: int | str | None = None, session: Any = None) -> ShardResult:
    """:func:`simulate_fsdp` as ZeRO ``stage`` 1, 2 or 3 does it, with torch's machinery:
    stage 1 shards the optimizer state (the cell's optimizer steps through torch's
    ``ZeroRedundancyOptimizer``; every rank keeps the whole model and its gradients), stage
    2 the gradients too (FSDP2 with ``reshard_after_forward=False``: the parameters gathered
    for a block's forward stay until its backward, as FSDP1's SHARD_GRAD_OP), stage 3 the
    parameters too (FSDP2 as it comes: :func:`simulate_fsdp`)."""
    styles = {1: "zero1", 2: "zero2", 3: "fsdp"}
    if stage not in styles:
        raise ValueError(f"ZeRO has stages 1, 2 and 3, not {stage!r}")
    return _simulate(cell, namespace, world_size, styles[stage], gpu, gpu_memory, session)


def shard_memory(cell: str | RunFn, namespace: Mapping[str, Any] | None = None, *,
                 world_sizes: Sequence[int] = WORLD_SIZES, gpu: Any = None,
                 gpu_memory: int | str | None = None, session: Any = None) -> list[ShardResult]:
    """:func:`simulate_fsdp` for each of ``world_sizes`` (default 2, 4, 8 GPUs)."""
    return [simulate_fsdp(cell, namespace, world_size=n, gpu=gpu, gpu_memory=gpu_memory,
                          session=session) for n in world_sizes]
