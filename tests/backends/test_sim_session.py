"""A simulated GPU that lasts the whole notebook (SimSession): cells share its memory."""

from __future__ import annotations

import gc
import textwrap

import pytest
import torch

from memmagic.core import _torch_private as priv
from memmagic.backends.sim import SimBackend, SimulatedValue, SimulatedValueError
from memmagic.backends.sim.errors import SimulationUnsupported
from memmagic.backends.sim.session import SimSession

from conftest import global_state

MODEL = 4 * (256 * 256 + 256) * 4  # four Linear(256, 256) in fp32: 1,052,672 B


class Notebook:
    """A namespace and a simulated GPU, cell after cell."""

    def __init__(self, **options) -> None:
        self.ns: dict = {}
        self.session = SimSession()
        self.options = {"gpu": "T4", **options}

    def sim(self, src: str, **options):
        code = compile(textwrap.dedent(src), "<cell>", "exec")
        backend = SimBackend(session=self.session, **{**self.options, **options})
        return backend.execute(lambda n: exec(code, n), self.ns)

    def real(self, src: str) -> None:
        exec(compile(textwrap.dedent(src), "<cell>", "exec"), self.ns)


STUDENT = [
    """
    import torch, torch.nn as nn
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = {"width": 256, "depth": 4, "lr": 1e-3}
    model = nn.Sequential(*[nn.Linear(config["width"], config["width"]) for _ in range(config["depth"])]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=config["lr"])
    """,
    """
    losses = []
    for step in range(3):
        x = torch.randn(32, config["width"], device=device)
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        losses.append(loss.item())
    allocated = torch.cuda.memory_allocated()
    """,
    """
    model.eval()
    with torch.no_grad():
        pred = model(torch.randn(8, config["width"], device=device)).argmax(1)
    shape = tuple(pred.shape)
    """,
]


def test_a_student_notebook_runs_across_cells():
    nb = Notebook()
    first = nb.sim(STUDENT[0])
    assert first.error is None, first.error
    assert first.report.before == 0 and first.report.after == MODEL
    # what holds no simulated tensor is real; the rest says where it lives
    assert nb.ns["device"] == torch.device("cuda") and nb.ns["config"]["width"] == 256
    assert isinstance(nb.ns["model"], SimulatedValue) and isinstance(nb.ns["opt"], SimulatedValue)
    second = nb.sim(STUDENT[1])
    assert second.error is None, second.error
    # the model made in the first cell is the second cell's ``before``
    assert second.report.before == MODEL
    # parameters, gradients and Adam's two moments stay (x and loss too: names keep them)
    assert nb.ns["allocated"] >= 4 * MODEL and second.report.after == nb.ns["allocated"]
    assert nb.ns["losses"] and len(nb.ns["losses"]) == 3
    third = nb.sim(STUDENT[2])
    assert third.error is None, third.error
    assert third.report.before == second.report.after
    assert nb.ns["shape"] == (8,)
    assert "model" in " ".join(third.report.notes)


def test_a_real_cell_that_touches_a_simulated_object_gets_one_line():
    nb = Notebook()
    nb.sim(STUDENT[0])
    with pytest.raises(SimulatedValueError) as exc:
        nb.real("model.train()")
    msg = str(exc.value)
    assert "\n" not in msg and "simulated GPU" in msg and "model" in msg
    # a name rebound by a real cell is the real cell's
    nb.real("model = torch.nn.Linear(2, 2)")
    out = nb.sim("y = model.cuda()(torch.ones(1, 2, device='cuda'))")
    assert out.error is None, out.error
    assert isinstance(nb.ns["model"], torch.nn.Linear)


def test_real_objects_stay_bit_identical_and_the_simulated_copy_persists():
    nb = Notebook()
    nb.real("""
        import torch
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256)
        alias = model            # another name for the same real object
        ref = {k: v.clone() for k, v in model.state_dict().items()}
    """)
    real_model = nb.ns["model"]
    out = nb.sim("""
        model.cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(4, 256, device="cuda")).sum().backward()
        opt.step()
    """)
    assert out.error is None, out.error
    assert nb.ns["model"] is real_model
    assert all(torch.equal(v, nb.ns["ref"][k]) for k, v in real_model.state_dict().items())
    assert real_model.weight.device.type == "cpu" and real_model.weight.grad is None
    # the next simulated cell gets the moved, trained copy, under both names
    out = nb.sim("""
        dev = str(model.weight.device)
        grad = model.weight.grad is not None
        same = alias is model
        mem = torch.cuda.memory_allocated()
    """)
    assert out.error is None, out.error
    assert nb.ns["dev"] == "cuda:0" and nb.ns["grad"] and nb.ns["same"]
    assert nb.ns["mem"] == out.report.before >= 2 * (256 * 256 + 256) * 4
    assert nb.ns["model"] is real_model and nb.ns["alias"] is real_model


def test_deleting_frees_the_simulated_memory():
    nb = Notebook()
    nb.sim("import torch\na = torch.empty(2**20, device='cuda')\nb = torch.empty(2**20, device='cuda')")
    out = nb.sim("del a")
    assert out.report.before == 2 * 4 * 2**20 and out.report.after == 4 * 2**20
    assert "a" not in nb.ns
    # a real cell that deletes the name frees it too, as the next simulated cell finds
    nb.real("del b")
    out = nb.sim("import torch\nn = torch.cuda.memory_allocated()")
    assert out.report.before == 0 and nb.ns["n"] == 0
    # the caching allocator keeps its blocks, as a GPU's does
    out = nb.sim("r = torch.cuda.memory_reserved()")
    assert nb.ns["r"] > 0


def test_the_card_keeps_table_entries_for_live_storages_only():
    """The card's tracker keeps the pool, role and saver of each storage it made while the
    storage lives, and the cell that freed it ends: a training cell run again and again
    leaves its tables as they were (they grew by every storage of every run before), and
    every report keeps its own cell's (issue 36)."""
    nb = Notebook()
    nb.sim(STUDENT[0])
    tracker = nb.session.card.tracker
    runs, sizes = [], []
    for _ in range(4):
        out = nb.sim(STUDENT[1])
        assert out.error is None, out.error
        runs.append(out.report)
        sizes.append({name: len(getattr(tracker, name)) for name in ("pool_of", "roles", "saver")})
    assert sizes[1] == sizes[2] == sizes[3]
    assert runs[1].peak == runs[2].peak == runs[3].peak
    for report in runs:  # the tables of a cell's trace are its own, whatever came after
        made = {serial for serial, delta, _ in report.trace.events if delta > 0}
        assert made and made <= set(report.trace.pool_of)
    at_peak = [r.trace.breakdown_at(r.trace.peak_event) for r in runs[1:]]
    assert at_peak[0] == at_peak[1] == at_peak[2]


def test_reset_empties_the_card():
    nb = Notebook()
    nb.sim("import torch\nw = torch.empty(2**20, device='cuda')")
    assert nb.session.reset() == 4 * 2**20
    with pytest.raises(SimulatedValueError, match="reset"):
        nb.real("w + 1")
    out = nb.sim("n = torch.cuda.memory_allocated()")
    assert out.report.before == 0 and nb.ns["n"] == 0


def _fakes() -> set[int]:
    gc.collect()
    return {id(t) for t in gc.get_objects() if isinstance(t, torch.Tensor) and priv.is_fake(t)}


def test_no_fake_survives_but_what_the_card_keeps():
    before = _fakes()  # other tests' simulated GPUs may hold some
    nb = Notebook()
    nb.sim(STUDENT[0])
    nb.sim(STUDENT[1])
    failed = nb.sim("big = torch.empty(2**40, device='cuda')")  # out of memory: kept nothing
    assert failed.error is not None
    kept = _fakes() - before
    # the card keeps the model, its gradients, Adam's state, x and loss: parameters, grads,
    # two moments (and the step counts) for 8 tensors, plus x, loss and their graph's ends
    assert 8 * 3 <= len(kept) <= 8 * 5 + 10
    nb.session.reset()
    assert not _fakes() - before


def test_out_of_memory_keeps_the_card_consistent():
    nb = Notebook(gpu_memory="64MiB", gpu=None)
    out = nb.sim("import torch\nkeep = torch.empty(8 * 2**20, device='cuda')")  # 32 MiB
    assert out.error is None
    out = nb.sim("big = torch.empty(16 * 2**20, device='cuda')")  # 64 MiB more: no room
    assert out.error is not None and "out of memory" in str(out.error)
    assert out.report.peak <= 64 * 2**20
    gc.collect()
    out = nb.sim("n = torch.cuda.memory_allocated()")
    assert nb.ns["n"] == 32 * 2**20 and "big" not in nb.ns


def test_another_card_takes_the_tensors_along():
    nb = Notebook()
    nb.sim("import torch\nw = torch.empty(2**25, device='cuda')")   # 128 MiB
    out = nb.sim("n = torch.cuda.memory_allocated()", gpu="A100-40GB")
    assert out.error is None, out.error
    assert nb.ns["n"] == 4 * 2**25
    assert "changed from T4" in " ".join(out.report.notes)
    with pytest.raises(SimulationUnsupported, match="reset"):
        nb.sim("x = 1", gpu_memory="64MiB", gpu=None)
    assert nb.session.card.target.name.startswith("A100")  # unchanged by the refusal


def test_a_cell_that_never_reaches_the_gpu_says_so():
    nb = Notebook()
    nb.real("import torch\ndevice = 'cpu'")
    out = nb.sim("x = torch.ones(100, device=device)")
    assert out.error is None
    assert any("no tensor reached the simulated GPU" in n for n in out.report.notes)


def test_simulated_runs_do_not_nest():
    nb = Notebook()
    out = nb.sim("""
        from memmagic.backends.sim import SimBackend
        SimBackend().execute(lambda ns: None, {})
    """)
    assert isinstance(out.error, SimulationUnsupported) and "inside another" in str(out.error)


def test_global_state_is_restored_between_cells():
    before = global_state()
    nb = Notebook()
    nb.sim(STUDENT[0])
    nb.sim("torch.set_default_device('cuda')\nz = torch.zeros(3)")
    assert global_state() == before
    out = nb.sim("dev = str(torch.zeros(1).device)")
    assert out.error is None
    assert nb.ns["dev"] == "cuda:0"  # set_default_device lasts, on the simulated GPU only


def test_an_overridden_card_size_is_said_in_the_report():
    nb = Notebook(gpu="T4", gpu_memory="6GiB")
    out = nb.sim("import torch\nx = torch.ones(4, device='cuda')")
    assert any(n.startswith("card size overridden: the T4's kernels with 6.00 GiB")
               for n in out.report.notes)


def test_a_sandboxed_rerun_beside_the_notebooks_simulated_objects(ip):
    """A what-if re-run (a sim run without the session) in a namespace holding placeholders
    of the notebook's simulated GPU runs, and leaves them as they were."""
    from memmagic.whatif.engine import Cell

    ip.run_cell_magic("gpumem", "--backend sim -q",
                      "w = torch.randn(256, 256, device='cuda', requires_grad=True)\n"
                      "loss = (w * 2).sum()")
    placeholder = ip.user_ns["loss"]
    cell = Cell("x = torch.randn(batch_size, 256, device='cuda')\ny = (x @ x.T).sum()",
                ip.user_ns, backend="sim", defaults={"batch_size": 8})
    r = cell.run(batch_size=64)
    assert r.error is None and r.peak >= 64 * 256 * 4
    assert ip.user_ns["loss"] is placeholder and "x" not in ip.user_ns


def _copy_run(nb: Notebook, src: str, **options):
    """A what-if run: starts from a copy of the notebook's card, leaves the names alone."""
    code = compile(textwrap.dedent(src), "<cell>", "exec")
    backend = SimBackend(start_from=nb.session, **{**nb.options, **options})
    saved = dict(nb.ns)
    try:
        return backend.execute(lambda n: exec(code, n), nb.ns)
    finally:
        nb.ns.clear()
        nb.ns.update(saved)


def test_a_run_on_a_copy_matches_a_run_on_the_card_and_leaves_it_alone():
    nb = Notebook()
    nb.sim(STUDENT[0])
    nb.sim(STUDENT[1])
    card = nb.session.card
    held, reserved, names = card.live_bytes(), card.reserved_bytes(), sorted(card.shadow)
    state = global_state()
    copied = _copy_run(nb, STUDENT[1])
    assert copied.error is None, copied.error
    assert global_state() == state
    assert nb.session.card is card and card.live_bytes() == held
    assert card.reserved_bytes() == reserved and sorted(card.shadow) == names
    on_card = nb.sim(STUDENT[1])  # the same cell on the notebook's card itself
    for field in ("before", "peak", "after", "reserved_peak", "reserved_after"):
        assert getattr(copied.report, field) == getattr(on_card.report, field), field
    assert copied.report.breakdown == on_card.report.breakdown
    assert nb.ns["allocated"] == on_card.report.after  # the real run's value, not the copy's


def test_a_run_on_a_copy_leaves_the_notebooks_plain_objects_as_they_were():
    """A what-if run works on copies of plain data too: a GradScaler made before its first
    step (it makes its scale at that step) and a list the step appends its losses to stay
    as they were in the notebook. (A ViT notebook's scaler held a simulated scale after the
    doctor's first re-run that fitted, and every re-run after it took another path, so the
    doctor found no line through them.) The notebook's own cell still works on them."""
    nb = Notebook()
    nb.sim(STUDENT[0])
    nb.sim("""
        scaler = torch.amp.GradScaler("cuda")
        losses = []
        def step(n):
            x = torch.randn(n, config["width"], device=device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt); scaler.update(); opt.zero_grad()
            losses.append(loss.item())
        """)
    scaler, losses = nb.ns["scaler"], nb.ns["losses"]
    runs = [_copy_run(nb, "step(32)") for _ in range(2)]
    assert all(r.error is None for r in runs), runs[0].error
    assert nb.ns["scaler"] is scaler and scaler._scale is None and losses == []
    # the second run did what the first did: it found the notebook as the first did
    logs = [[e["size"] for e in r.report.trace.allocator_log.entries if e["action"] == "alloc"]
            for r in runs]
    assert logs[0] == logs[1] and 4 in logs[0]  # the scale, made at the step
    assert runs[0].report.peak == runs[1].report.peak
    assert nb.sim("step(32)").error is None  # the notebook's own cell: for real
    assert losses == [1.0] and "scaler" in nb.session.card.shadow


def test_a_run_on_a_copy_has_every_attribute_of_the_notebooks_optimizer():
    """An optimizer's own deepcopy keeps three attributes (``Optimizer.__getstate__``):
    nanochat's MuonAdamW keeps its step counts as 0-d tensors of its own, and every what-if
    run on a copy of the card failed on "no attribute". The copy has all of them, its
    tensors copied as the card's are, and the notebook's optimizer is left as it was."""
    nb = Notebook()
    nb.sim(STUDENT[0])
    nb.sim("""
        class Counted(torch.optim.SGD):
            def __init__(self, params, **kw):
                super().__init__(params, **kw)
                self.steps_t = torch.tensor(0.0)
                self.log = []

            def step(self):
                self.steps_t += 1
                self.log.append(self.steps_t)
                return super().step()

        counted = Counted(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(counted, 1)
        """)
    counted = nb.ns["counted"]
    run = _copy_run(nb, "model(torch.randn(4, 256, device='cuda')).sum().backward()\n"
                        "counted.step(); sched.step()\n"
                        "assert counted.log and counted.steps_t is counted.log[-1]")
    assert run.error is None, run.error
    assert nb.ns["counted"] is counted
    # (the scheduler's mark that a step ran is the copy's too)
    assert nb.sim("assert counted.log == [] and counted.steps_t.item() == 0\n"
                  "assert not getattr(counted, '_opt_called', False)").error is None


def test_copies_leave_no_fake_behind():
    nb = Notebook()
    nb.sim(STUDENT[0])
    nb.sim(STUDENT[1])
    _copy_run(nb, STUDENT[1])
    before = _fakes()
    for _ in range(5):
        assert _copy_run(nb, STUDENT[1]).error is None
    assert _copy_run(nb, "big = torch.empty(2**40, device='cuda')").error is not None
    assert not _fakes() - before
    nb.session.reset()


def test_a_copy_keeps_values_code_reads_and_the_allocator_cache():
    nb = Notebook()
    nb.sim(STUDENT[0])
    nb.sim(STUDENT[1])
    nb.sim("tmp = torch.empty(2**22, device='cuda')\ndel tmp")  # 16 MiB cached, not held
    out = _copy_run(nb, "r = torch.cuda.memory_reserved()\na = torch.cuda.memory_allocated()\n"
                        "steps = [int(s['step']) for s in opt.state.values()]\n"
                        "w = tuple(model[0].weight.shape)\nassert steps == [3] * 8, steps\n"
                        "assert w == (256, 256)\nassert model[0].weight.grad is not None")
    assert out.error is None, out.error
    assert out.report.before == nb.session.card.live_bytes()
    assert out.report.reserved_peak == nb.session.card.reserved_bytes()
    nb.session.reset()
