"""The trace beneath every tracker-based report: phases, modules, ops, per-module table."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import memmagic
from memmagic.core import _torch_private as priv
from memmagic import zoo
from memmagic.report import Category
from memmagic.trace import NO_MODULE, PHASES, Trace, module_rows_at


def _step(model, opt, batch):
    def run():
        zoo.train_step(model, opt, batch)
    return run


def _phase_order(trace: Trace) -> list[str]:
    """The phases in the order they first appear (other phases left out)."""
    seen: list[str] = []
    for phase, _, _ in trace.phase_spans():
        if phase != "other" and phase not in seen:
            seen.append(phase)
    return seen


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_mlp_peak_is_in_the_optimizer_step(backend):
    """An MLP's Adam step: parameters, gradients, the new moment tensors and the step's
    temporaries together are the peak; it is named as the step, with the optimizer."""
    model, batch = zoo.build("mlp")
    opt = torch.optim.Adam(model.parameters())
    if backend == "sim":
        src = zoo.step_source("mlp").replace("AdamW", "Adam")
        r = memmagic.measure(lambda: exec(src, {}), backend="sim")
    else:
        r = memmagic.measure(_step(model, opt, batch), backend="cpu")
    assert r.peak_phase == "optimizer"
    assert r.peak_label.startswith("Adam")
    assert r.peak_words.startswith("during optimizer.step() (Adam")
    assert _phase_order(r.trace) == ["forward", "backward", "optimizer"]
    if backend == "sim":  # CUDA's default: foreach
        assert "foreach" in r.peak_label and r.peak_words.endswith(f": {r.peak_op.split('.')[0]})")


def test_transformer_peak_is_in_backward_with_its_module():
    """Without an optimizer step, a transformer's peak is in backward: the words name the
    phase, the block whose ops run backward, and the autograd node."""
    model, batch = zoo.build("transformer")
    x, y = batch

    def run():
        model.loss(x, y).backward()

    r = memmagic.measure(run, backend="cpu")
    assert r.peak_phase == "backward"
    assert r.peak_label.endswith("backward")
    where = f" in `{r.peak_module}`" if r.peak_module else ""
    assert r.peak_words.startswith(f"during loss.backward(){where} ({r.peak_label}")
    assert "_" not in r.peak_words.split("(", 1)[1].split(":")[0]  # the label is words
    assert _phase_order(r.trace) == ["forward", "backward"]
    # backward ops are named by the module whose forward made their autograd node
    bw_modules = {m for _, m, p, _ in r.trace.ops if p == "backward" and m}
    assert {f"ZooModel.blocks.{i}.attn" for i in range(2)} <= {
        ".".join(m.split(".")[:4]) for m in bw_modules}
    assert any(lbl and lbl.startswith("scaled dot product") for _, _, p, lbl in r.trace.ops
               if p == "backward") or any(lbl for _, _, p, lbl in r.trace.ops if p == "backward")


def test_checkpointed_recompute_is_visible():
    model, batch = zoo.build("transformer", checkpointing=True)
    x, y = batch
    r = memmagic.measure(lambda: model.loss(x, y).backward(), backend="cpu")
    spans = r.trace.phase_spans()
    phases = [p for p, _, _ in spans]
    assert "recompute" in phases
    # one recompute per checkpointed block, each inside backward
    first_backward = next(a for p, a, _ in spans if p == "backward")
    recomputes = [(a, b) for p, a, b in spans if p == "recompute"]
    assert len(recomputes) == len(model.blocks)
    assert all(a > first_backward for a, _ in recomputes)
    modules = {".".join(r.trace.op(a)[1].split(".")[:3]) for a, _ in recomputes}
    assert modules == {f"ZooModel.blocks.{i}" for i in range(len(model.blocks))}
    # without checkpointing there is none, and the activations saved are larger
    plain_model, _ = zoo.build("transformer")
    plain = memmagic.measure(lambda: plain_model.loss(x, y).backward(), backend="cpu")
    assert "recompute" not in {p for p, _, _ in plain.trace.phase_spans()}
    assert r.breakdown["activations"] < plain.breakdown["activations"]


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_module_activations_sum_to_the_category(backend):
    src = zoo.step_source("transformer")
    if backend == "cpu":
        src = src.replace("device='cuda'", "device='cpu'")
    src = src.replace("loss = zoo.train_step(model, opt, batch, amp=False)",
                      "loss = model.loss(*batch)")  # peak with the activations alive
    r = memmagic.measure(lambda: exec(src, {}), backend=backend)
    act = r.breakdown[Category.ACTIVATIONS.value]
    assert act > 0
    assert sum(row.activations for row in r.modules) == act
    for depth in (1, 2, 3, None):
        rows = r.modules_at(depth)
        assert sum(row.activations for row in rows) == act
    blocks = {row.module: row for row in r.modules_at(3)}
    b0, b1 = blocks["ZooModel.blocks.0"], blocks["ZooModel.blocks.1"]
    assert b0.activations == b1.activations > 0  # two identical blocks save the same
    assert b0.parameters == b1.parameters > 0
    assert abs(sum(row.share for row in r.modules_at(1)) - act / r.peak) < 1e-9
    d = r.to_dict()["modules"]
    assert sum(m["activations"] for m in d) == act


def test_a_model_called_twice_and_accumulation():
    """Two forwards before one backward keep both graphs: each block's saved bytes double;
    an accumulation loop (backward per micro-batch) does not double them."""
    model, (x, y) = zoo.build("mlp")

    def once():
        model.loss(x, y)

    def twice():
        a = model.loss(x, y)
        b = model.loss(x, y)
        (a + b).backward()

    def accumulate():
        for _ in range(3):
            model.loss(x, y).backward()

    one = memmagic.measure(lambda: model.loss(x, y).sum(), backend="cpu")
    two = memmagic.measure(twice, backend="cpu")
    acc = memmagic.measure(accumulate, backend="cpu")
    rows1 = {r.module: r for r in one.modules_at(3)}
    rows2 = {r.module: r for r in two.modules_at(3)}
    block = next(m for m in rows1 if ".blocks." in m)
    assert rows1[block].activations_max > 0
    assert rows2[block].activations_max == 2 * rows1[block].activations_max
    rowsa = {r.module: r for r in acc.modules_at(3)}
    assert rowsa[block].activations_max == rows1[block].activations_max
    assert sum(r.activations for r in acc.modules) == acc.breakdown["activations"]
    del once


def test_storages_know_their_op_module_phase_and_free():
    model, (x, y) = zoo.build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    r = memmagic.measure(_step(model, opt, (x, y)), backend="cpu")
    st = r.trace.storages()
    made = [s for s in st if s.op > 0]
    assert made and all(s.op_name and s.phase in PHASES for s in made)
    fwd = [s for s in made if s.phase == "forward" and s.module and ".blocks." in s.module]
    assert fwd, "forward storages made inside the blocks"
    grads = [s for s in st if s.category == "gradients"]
    assert grads and all(s.phase == "backward" for s in grads if s.op > 0)
    # activations saved in forward are freed by backward
    saved = [s for s in made if s.saved_by is not None]
    assert saved and all(s.freed is not None and r.trace.op(s.freed)[2] == "backward"
                         for s in saved if s.phase == "forward")
    # the events and the storages agree on the peak
    assert r.trace.breakdown_at(r.trace.peak_event) == dict(r.breakdown)
    tl = r.trace.timeline()
    assert max(sum(c.values()) for _, c in tl) == r.peak
    assert [op for op, _ in tl] == sorted(op for op, _ in tl)
    assert tuple((op, sum(c.values())) for op, c in tl) == r.timeline


def test_root_module_named_by_its_variable(ip):
    ip.run_cell("from memmagic import zoo\nmodel, (x, y) = zoo.build('mlp')")
    r = ip.run_cell_magic("gpumem", "--backend cpu -o -q", "model.loss(x, y).backward()")
    assert r.peak_module is None or r.peak_module.startswith("model")
    assert any(row.module.startswith("model.blocks") for row in r.modules)
    r = ip.run_cell_magic("gpumem", "--backend sim -o -q",
                          "net, (a, b) = zoo.build('mlp', device='cuda')\nnet.loss(a, b).backward()")
    assert any(row.module.startswith("net.blocks") for row in r.modules)


LOOP_MODEL = """\
import torch.nn as nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
                                    for _ in range(3))
model = Net().to(dev)
layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
                       for _ in range(2)).to(dev)
x = torch.randn(32, 64, device=dev)
"""


@pytest.mark.parametrize("backend", ["cpu", "sim"])
@pytest.mark.parametrize("owner,n", [("model.layers", 3), ("layers", 2)])
def test_a_loop_variable_does_not_name_the_layers_it_runs(ip, backend, owner, n):
    """Issue 23, item 6: ``for l in model.layers: h = l(h)`` in a cell named every layer
    ``l`` (the loop variable holds each in turn), so the rows of all layers merged into
    ``l.0``, ``l.2``: the owner's path wins over a loop variable."""
    if backend == "sim":  # the model on the notebook's simulated GPU
        ip.run_cell_magic("gpumem", "--backend sim -q --no-chart", 'dev = "cuda"\n' + LOOP_MODEL)
    else:
        ip.run_cell('dev = "cpu"\n' + LOOP_MODEL)
    r = ip.run_cell_magic("gpumem", f"--backend {backend} -o -q --no-chart",
                          f"h = x\nfor l in {owner}:\n    h = l(h)\nh.sum().backward()")
    paths = {row.module for row in r.modules}
    assert not any(p == "l" or p.startswith("l.") for p in paths), sorted(paths)
    for i in range(n):
        assert f"{owner}.{i}.0" in paths and f"{owner}.{i}.2" in paths, sorted(paths)
    assert r.peak_module is None or r.peak_module.startswith(owner + ".")
    # every layer's rows are its own: the parameters of each layer's first Linear, once
    assert all(next(row for row in r.modules if row.module == f"{owner}.{i}.0").parameters
               == (64 * 256 + 256) * 4 for i in range(n))


def test_a_variable_still_names_a_module_nothing_else_holds(ip):
    ip.run_cell('dev = "cpu"\n' + LOOP_MODEL + "block = nn.Linear(64, 64)\n")
    r = ip.run_cell_magic("gpumem", "--backend cpu -o -q --no-chart", "block(x).sum().backward()")
    assert {row.module for row in r.modules} == {"block"}


def test_sim_trace_of_a_notebook_card_is_its_own(ip):
    """On the notebook's simulated GPU (one tracker for all cells), a report's trace is not
    changed by the cells after it."""
    ip.run_cell("from memmagic import zoo")
    r1 = ip.run_cell_magic("gpumem", "--backend sim -o -q",
                           "model, batch = zoo.build('mlp', device='cuda')\nloss = model.loss(*batch)")
    n_ops, n_events = len(r1.trace.ops), len(r1.trace.events)
    before = r1.trace.breakdown_at(r1.trace.peak_event)
    r2 = ip.run_cell_magic("gpumem", "--backend sim -o -q", "loss.backward()")
    assert (len(r1.trace.ops), len(r1.trace.events)) == (n_ops, n_events)
    assert r1.trace.breakdown_at(r1.trace.peak_event) == before
    assert _phase_order(r2.trace) == ["backward"]
    assert sum(row.activations for row in r1.modules) == r1.breakdown["activations"] > 0


def test_simulated_oom_names_module_phase_and_line(ip):
    cell = ("model, (x, y) = zoo.build('transformer', device='cuda', size='bench')\n"
            "loss = model.loss(x, y)\n"
            "loss.backward()\n")
    ip.run_cell("from memmagic import zoo")
    r = ip.run_cell_magic("gpumem", "--backend sim --gpu-memory 80MiB --no-raise -o -q", cell)
    assert r.failed_request is not None
    msg = r.error
    assert "CUDA out of memory (simulated)" in msg
    assert " in module model." in msg and "line " in msg
    assert any(p in msg for p in (" during forward", " during loss.backward()"))


def test_module_rows_at_validates_depth():
    r = memmagic.MemoryReport(backend="cpu", device="cpu", before=0, peak=1, after=0, wall_s=0.0)
    with pytest.raises(ValueError, match="depth"):
        r.modules_at(0)
    assert module_rows_at((), 2, 1) == []
    assert r.modules_at() == []


def test_report_equality_and_repr_ignore_the_trace():
    model, (x, y) = zoo.build("mlp")
    r = memmagic.measure(lambda: model.loss(x, y), backend="cpu")
    assert "Trace" not in repr(r) and "trace" not in str(r)
    from dataclasses import replace

    assert replace(r, trace=None) == r


def test_trace_memory_per_op_is_small():
    """A trace keeps one small tuple per op and per event: well under 1 KiB an op."""
    import sys

    model, (x, y) = zoo.build("transformer")
    opt = torch.optim.Adam(model.parameters())
    r = memmagic.measure(_step(model, opt, (x, y)), backend="cpu")
    t = r.trace
    size = sys.getsizeof(t.ops) + sum(sys.getsizeof(o) for o in t.ops)
    size += sys.getsizeof(t.events) + sum(sys.getsizeof(e) for e in t.events)
    assert size / len(t.ops) < 1024


# -- the private APIs the trace rests on (contract) -----------------------------------------
def test_private_sequence_numbers_name_backward_nodes():
    x = torch.randn(3, requires_grad=True)
    before = priv.next_sequence_nr()
    y = (x * 2).softmax(0)
    assert priv.next_sequence_nr() == before + 2
    seen = []

    def hook(grad):
        seen.append(priv.current_autograd_node())

    y.register_hook(hook)
    assert priv.current_autograd_node() is None
    y.sum().backward()
    assert seen and seen[0] is not None
    seq, name = seen[0]
    assert isinstance(seq, int) and name == "SoftmaxBackward0"  # y's own node


def test_phase_names_are_the_documented_ones():
    assert set(PHASES) == {"forward", "backward", "recompute", "optimizer", "other"}
    assert NO_MODULE.startswith("(")


def test_the_trace_needs_no_torch_and_tracking_no_presentation():
    import subprocess
    import sys

    def loaded(imports: str, modules: tuple[str, ...]) -> str:
        code = f"import sys, {imports}; print([m for m in {modules!r} if m in sys.modules])"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout.strip()

    assert loaded("memmagic.trace", ("torch", "IPython", "matplotlib")) == "[]"
    assert loaded("memmagic.core.tracking, memmagic.trace, memmagic.backends.sim",
                  ("IPython", "ipywidgets", "matplotlib")) == "[]"


def test_live_at_the_peak_adds_up_to_the_breakdown():
    model, (x, y) = zoo.build("mlp")
    r = memmagic.measure(lambda: model.loss(x, y).backward(), backend="cpu")
    live = r.trace.live_at()
    assert sum(s.nbytes for s, _ in live) == r.peak
    by_cat: dict[str, int] = {}
    for s, cat in live:
        by_cat[cat] = by_cat.get(cat, 0) + s.nbytes
    assert {k: v for k, v in r.breakdown.items() if v} == by_cat
    assert [s.nbytes for s, _ in live] == sorted((s.nbytes for s, _ in live), reverse=True)
    with pytest.raises(IndexError):
        r.trace.live_at(len(r.trace.events) + 5)


def test_a_report_replays_its_trace_once(monkeypatch):
    """The breakdown at the peak, the timeline and the per-module rows come from one replay
    of the run's trace (an evaluation loop's run has hundreds of thousands of events): the
    breakdown is the replay's at the peak event, and a copy of the trace whose storages
    were made gives the same module rows and timeline."""
    steps = []
    replay = Trace._replay

    def counted(self):
        for step in replay(self):
            steps.append(step[0])
            yield step

    monkeypatch.setattr(Trace, "_replay", counted)
    r = memmagic.measure(lambda: exec(zoo.step_source("transformer"), {}), backend="sim")
    tr = r.trace
    # one whole replay, and the start's breakdown (the first step of another)
    assert len(tr.events) > 500 and len(steps) == len(tr.events) + 2
    assert r.modules and r.timeline and r.breakdown
    fresh = Trace(ops=tr.ops, events=tr.events, saved_events=tr.saved_events,
                  pool_of=tr.pool_of, roles=tr.roles, seed=tr.seed, saver=tr.saver,
                  owner=tr.owner, frames=tr.frames, peak_event=tr.peak_event,
                  before=tr.before, frozen=tr.frozen)
    fresh.storages()  # made or not, module_rows reads the same sizes
    assert tuple(fresh.module_rows(r.peak)) == r.modules
    points = [(op, sum(c.values())) for op, c in fresh.timeline()]
    assert tuple(points) == tuple(r.timeline)
    for i, _, cats, _, _, _ in replay(fresh):
        if i == tr.peak_event:
            assert dict(cats) == r.breakdown
