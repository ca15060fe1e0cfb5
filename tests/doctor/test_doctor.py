"""The memory doctor: holders of retained memory, leaks with their fix, failed cells,
out-of-memory descriptions and the ranking of fixes by re-run peaks."""

from __future__ import annotations

import gc
import re
import sys
import weakref

import pytest
import torch

from memmagic import doctor
from memmagic.pipeline import ranking_engine

SETUP = ("import torch\n"
         "model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))\n"
         "x = torch.randn(64, 256)\n")


def _cell(ip, source):
    res = ip.run_cell(source)
    assert res.error_in_exec is None, res.error_in_exec
    return res


def test_each_holder_kind_is_named(ip):
    _cell(ip, SETUP)
    before = doctor.snapshot(ip.user_ns)
    _cell(ip, "a = torch.ones(1000)\n"                       # variable
              "model.cache = torch.ones(2000)\n"             # attribute
              "items = [0, torch.ones(3000)]\n"              # container index
              "stats = {'loss': torch.ones(4000)}\n"         # dict key
              "def make():\n"
              "    kept = torch.ones(5000)\n"
              "    def f(): return kept\n"
              "    return f\n"
              "logger = make()\n")                           # closure
    r = doctor.retained(ip.user_ns, since=before)
    assert r["a"].nbytes == 4000
    assert r["model.cache"].nbytes == 8000
    assert r["items[1]"].nbytes == 12000
    assert r["stats['loss']"].nbytes == 16000
    assert r["logger.<closure>.kept"].nbytes == 20000
    assert [h.name for h in r.rows][:1] == ["logger.<closure>.kept"]  # largest first
    assert "x" not in {n for h in r.rows for n in h.names}  # made before the cell
    assert "model" not in {n for h in r.rows for n in h.names}


def test_a_wrapped_model_is_named_as_the_user_named_it(ip):
    """A wrapper that keeps a bound method of the model it wraps (peft's ``PeftModel``
    keeps ``base_model_prepare_inputs_for_generation``) reaches the model's parameters a
    second way, walked first: the row is still ``model``'s, not
    ``model.prepare.__self__``'s."""
    _cell(ip, "import torch\n"
              "class Wrapper(torch.nn.Module):\n"
              "    def __init__(self, inner):\n"
              "        super().__init__()\n"
              "        self.inner = inner\n"
              "        self.prepare = inner.forward\n"
              "before = None\n")
    before = doctor.snapshot(ip.user_ns)
    _cell(ip, "model = Wrapper(torch.nn.Linear(100, 100))\n")
    r = doctor.retained(ip.user_ns, since=before)
    assert [h.name for h in r.rows] == ["model"]
    assert r["model"].nbytes == (100 * 100 + 100) * 4


def test_out_and_underscore_hold_a_models_output_with_its_graph(ip):
    _cell(ip, SETUP)
    before = doctor.snapshot(ip.user_ns)
    res = ip.run_cell("model(x)", store_history=True)  # a notebook cell: its result goes to Out
    n = res.execution_count
    r = doctor.retained(ip.user_ns, since=before)
    h = r[f"Out[{n}]"]
    assert "_" in h.names and h.names[0] == f"Out[{n}]"
    assert h.graph_bytes >= 64 * 1024 * 4  # the hidden activations the graph saved
    assert f"del Out[{n}]" in h.fix and "`;`" in h.fix


def test_epoch_loss_leak_is_named_with_its_holder_and_fix(ip):
    _cell(ip, SETUP)
    before = doctor.snapshot(ip.user_ns)
    _cell(ip, "epoch_loss = 0\n"
              "for _ in range(4):\n"
              "    loss = model(x).square().mean()\n"
              "    epoch_loss += loss\n")
    r = doctor.retained(ip.user_ns, since=before)
    h = r["epoch_loss"]
    assert h in r.leaks
    assert "4 losses" in h.problem and "`epoch_loss`" in h.problem
    assert "loss.item()" in h.fix and ".detach()" in h.fix
    # three earlier iterations' graphs are pinned only through epoch_loss: at least
    # their 64x1024 hidden activations (the last one is shared with `loss`)
    assert h.graph_bytes >= 3 * 64 * 1024 * 4


def test_a_list_of_outputs_kept_with_their_graphs(ip):
    _cell(ip, SETUP)
    before = doctor.snapshot(ip.user_ns)
    _cell(ip, "history = []\nfor _ in range(3):\n    history.append(model(x))\n")
    r = doctor.retained(ip.user_ns, since=before)
    h = r["history[...]"]
    assert h.tensors == 3 and h in r.leaks
    assert "3 tensors with their autograd graphs" in h.problem and ".detach()" in h.fix
    # and detached outputs are no leak
    _cell(ip, "clean = [model(x).detach() for _ in range(3)]\n")
    assert doctor.retained(ip.user_ns, since=before)["clean[...]"].problem is None


def test_retained_numbers_match_the_magic_report(ip):
    _cell(ip, SETUP)
    before = doctor.snapshot(ip.user_ns)
    rep = ip.run_cell_magic("gpumem", "--backend cpu -o -q", "kept = torch.ones(1 << 16)\n"
                                                           "tmp = model(x).detach()")
    r = doctor.retained(ip.user_ns, since=before, report=rep)
    assert r.total == rep.retained == (1 << 16) * 4 + 64 * 10 * 4
    assert r.unnamed == 0
    assert "kept" in str(r) and "kept" in r._repr_html_()


def test_a_failed_cells_traceback_bytes_are_named_and_freed_by_one_call(ip):
    _cell(ip, "import weakref\nrefs = []\n"
              "def step():\n"
              "    big = torch.ones(1 << 18)\n"
              "    refs.append(weakref.ref(big))\n"
              "    raise ValueError('boom')\n")
    res = ip.run_cell("%%gpumem --backend cpu -q\nstep()")
    assert isinstance(res.error_in_exec, ValueError)
    hold = doctor.traceback_holdings(res.error_in_exec, ip.user_ns)
    assert hold.nbytes == (1 << 18) * 4 and "step:big" in hold.names
    assert doctor.FREE_CALL in str(hold)
    # reporting it broke nothing %debug needs: the frame still has its variable
    frames = []
    tb = sys.last_traceback
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    assert any("big" in f.f_locals for f in frames)
    assert ip.user_ns["refs"][0]() is not None
    assert doctor.free_traceback() >= 1
    gc.collect()
    assert ip.user_ns["refs"][0]() is None


def test_after_a_simulated_oom_the_card_is_back_to_its_baseline():
    from memmagic.backends.sim import SimBackend
    from memmagic.backends.sim.session import SimSession

    session = SimSession()
    be = SimBackend(gpu_memory="256MiB", session=session)
    ns = {"torch": torch}
    be.execute(lambda n: exec("model = torch.nn.Linear(1024, 1024).cuda()", n), ns)
    base = session.card.live_bytes()
    src = ("def step():\n"
           "    a = torch.randn(4096, 4096, device='cuda')\n"
           "    b = a * 2\n"
           "    c = torch.empty(8192, 8192, device='cuda')\n"
           "step()\n")
    out = be.execute(lambda n: exec(compile(src, "<cell>", "exec"), n), ns)
    assert out.report.failed_request == 8192 * 8192 * 4
    assert session.card.live_bytes() == base + 2 * 64 * 2**20
    d = doctor.describe_oom(out.report, out.error, {k: s.value for k, s in session.card.shadow.items()})
    assert d.requested == 8192 * 8192 * 4 and d.live == base + 2 * 64 * 2**20
    assert dict(d.by_holder)["model"] == 1024 * 1024 * 4 + 1024 * 4
    assert dict(d.by_holder)["the failed cell's frames (activations, temporaries)"] == 2 * 64 * 2**20
    assert d.by_category["other"] == 2 * 64 * 2**20
    assert d.op == "empty" and d.line.startswith("line 4")
    released = doctor.release_failed_cell(out.error)
    assert released.freed == 2 * 64 * 2**20
    gc.collect()
    assert session.card.live_bytes() == base


CNN = """
import torch
from memmagic import zoo
model, (x, y) = zoo.build("cnn", device="cuda")
x = x.repeat(batch_size // x.shape[0], 1, 1, 1)
y = y.repeat(batch_size // y.shape[0])
opt = torch.optim.Adam(model.parameters())
model.loss(x, y).backward()
opt.step()
"""


def test_a_cnn_where_a_smaller_batch_is_the_only_fix_that_fits():
    base, rows, notes = doctor.rank(ranking_engine(CNN, {"batch_size": 256}, gpu_memory="256MiB"))
    assert base.fits is False
    fitting = [s for s in rows if s.fits]
    assert fitting[0].knobs == {"batch_size": 64}
    assert rows[0] is fitting[0]  # ranked first: the smallest peak
    # the line through batches 32 and 64 (cuDNN's convolution workspaces included) says batch
    # 79 fits; the cell repeats its batch in whole copies of 32, so the run at 79 is one at
    # 64: a plain row, and a note says why
    assert [s.knobs for s in fitting[1:]] == [{"batch_size": 79}]
    assert fitting[1].label == "batch 79 (from 256)"
    assert any(n.startswith("batch 79 (from 256): read off the re-runs, it fits with")
               for n in notes)
    assert all(s.need is not None for s in rows)
    tried = {next(iter(s.knobs)) for s in rows if s.knobs}
    assert {"batch_size", "amp", "checkpointing"} <= tried
    # out of memory in the first backward, before the optimizer made its state: another
    # optimizer would run out there too, so it is not re-run (a note says so)
    assert "optimizer" not in tried
    assert any(n.startswith("optimizer: not re-run, the cell ran out of memory before its "
                            "first optimizer step began") for n in notes)


GPT = """
import torch
from memmagic import zoo
torch.manual_seed(0)
model = zoo._gpt("manual", 50257, 256, 4, 4, seq, dropout=0.0).cuda()
x = torch.randint(50257, (batch_size, seq), device="cuda")
opt = torch.optim.AdamW(model.parameters())
model.loss(x, x).backward()
opt.step()
"""


@pytest.mark.slow
def test_amp_beats_checkpointing_at_short_sequence_and_loses_at_long():
    def order(seq, batch):
        _, rows, _ = doctor.rank(ranking_engine(GPT, {"seq": seq, "batch_size": batch}),
                                 knobs=("amp", "checkpointing"))
        return [s.label for s in rows if s.label in ("AMP fp16", "activation checkpointing")]

    assert order(64, 16) == ["AMP fp16", "activation checkpointing"]  # the logits dominate
    assert order(1024, 2) == ["activation checkpointing", "AMP fp16"]  # the S x S attention


def test_advice_is_data_and_renders_deterministically(ip):
    _cell(ip, SETUP)
    before = doctor.snapshot(ip.user_ns)
    _cell(ip, "total = 0\nfor _ in range(2):\n    total += model(x).mean()\n")
    a = doctor.advise(ip.user_ns, since=before)
    assert a.retained["total"].problem
    d = a.to_dict()
    assert d["retained"]["rows"][0]["names"][0] == "total"
    assert str(a) == str(doctor.advise(ip.user_ns, since=before))
    assert a._repr_html_() == doctor.advise(ip.user_ns, since=before)._repr_html_()
    assert "<table>" in a._repr_html_()


def test_advice_after_a_non_oom_error_keeps_the_traceback():
    def fail():
        t = torch.ones(1000)
        ref.append(weakref.ref(t))
        raise KeyError("x")

    ref: list = []
    try:
        fail()
    except KeyError as exc:
        err = exc
    a = doctor.advise({}, error=err)
    assert a.failure.nbytes == 4000 and a.oom is None
    assert ref[0]() is not None  # not freed: %debug may want it
    doctor.free_traceback(err)
    gc.collect()
    assert ref[0]() is None


def test_fsdp_rows_join_the_ranking_with_the_sharding_numbers():
    from tests.whatif.test_sharding import STEP

    base, rows, notes = doctor.rank(ranking_engine(STEP), knobs=(), world_sizes=(2, 4))
    assert any(n.startswith("FSDP2 and tensor-parallel rows leave out NCCL's own buffers") and "NVIDIA/nccl#1685" in n
               for n in notes)
    assert any(n.startswith("the FSDP2 rows are ZeRO-3") for n in notes)
    assert any(n.startswith("pipeline stages: not re-run by the doctor") for n in notes)
    by = {next(iter(s.knobs.items())): s for s in rows}
    # FSDP2 (ZeRO-3) at every size; ZeRO-2 and ZeRO-1 at the most GPUs tried
    assert set(by) == {("fsdp_world_size", 4), ("fsdp_world_size", 2),
                       ("zero2_world_size", 4), ("zero1_world_size", 4)}
    assert by["fsdp_world_size", 4].label == "shard over 4 GPUs (FSDP2)"
    assert by["zero1_world_size", 4].label.startswith("ZeRO-1 over 4 GPUs")
    assert [s.peak for s in rows] == sorted(s.peak for s in rows)  # ranked
    assert by["fsdp_world_size", 4].peak < by["fsdp_world_size", 2].peak < base.peak
    # less sharded, more memory: ZeRO-3 < ZeRO-2 < ZeRO-1 < one GPU
    assert (by["fsdp_world_size", 4].peak < by["zero2_world_size", 4].peak
            < by["zero1_world_size", 4].peak < base.peak)


def test_sharded_rows_that_run_out_of_memory_read_as_lower_bounds():
    """A sharded run that runs out says what it needs at least (live + the request), as
    the knob rows do, not the peak it reached before failing."""
    from memmagic.doctor.ranking import _shard_rows
    from tests.whatif.test_sharding import STEP

    big = STEP.replace("512, 512", "1536, 1536").replace("8, 512", "8, 1536")  # 36 MiB
    rows = _shard_rows(big, None, (2,), None, "64MiB")
    assert [next(iter(s.knobs)) for s in rows] == ["fsdp_world_size", "zero2_world_size",
                                                   "zero1_world_size"]
    for s in rows:
        assert s.out_of_memory and s.fits is False and s.reserved_peak is None, s
        assert s.reason.startswith("out of memory asking for")
    assert "> " in doctor.Advice(strategies=tuple(rows)).strategy_rows()[0][1]


def test_the_namespace_view_of_a_simulated_gpu_shows_its_objects():
    from memmagic.backends.sim import SimBackend
    from memmagic.backends.sim.session import SimSession

    session = SimSession()
    ns = {"torch": torch}
    SimBackend(session=session).execute(lambda n: exec("w = torch.ones(1000, device='cuda')", n), ns)
    view = doctor.namespace_view(ns, session)
    assert isinstance(view["w"], torch.Tensor)
    assert doctor.retained(view)["w"].nbytes == 4000


# -- issue 23, item 9: every byte a list of outputs pins is named -----------------------------
FUNCTION = """
class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x * 2)      # saved through save_for_backward
        ctx.mask = torch.ones_like(x)     # kept as an attribute of ctx
        return x * 3
    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved_tensors[0] * ctx.mask
"""


def test_a_custom_functions_saved_tensors_are_pinned_by_its_holder(ip):
    """A custom autograd.Function's node keeps its tensors in ``ctx.saved_tensors`` and
    ctx's attributes, not in ``_saved_*``: the doctor missed them and called them "held by
    no name" (the simulated GPU's flash attention is such a Function)."""
    _cell(ip, SETUP + FUNCTION)
    before = doctor.snapshot(ip.user_ns)
    rep = ip.run_cell_magic("gpumem", "--backend cpu -o -q",
                            "kept = []\nfor _ in range(3):\n    kept.append(Scale.apply(model(x)))\n")
    r = doctor.retained(ip.user_ns, since=before, report=rep)
    h = r["kept[...]"]
    # each output (64x10 fp32, 2560 B) pins its Linear/ReLU activations and the Function's
    # two saved 64x10 tensors: ctx's x * 2 and ctx.mask
    assert h.graph_bytes >= 3 * 2 * 64 * 10 * 4 + 3 * 64 * 1024 * 4
    assert r.unnamed == 0 and r.total == rep.retained


def test_model_outputs_kept_in_a_list_add_up_on_the_simulated_gpu(ip):
    """The issue's cell: ``preds.append(model(x).logits)`` four times with a transformers
    GPT-2 built from a config: every retained byte is in ``preds`` (the logits, and the
    graphs they pin, flash attention's saved tensors included), none "held by no name";
    the cuBLAS workspace the first matmul made is named as such."""
    pytest.importorskip("transformers")
    ip.run_line_magic("gpusim", "on --gpu T4")
    try:
        _cell(ip, "from transformers import GPT2Config, GPT2LMHeadModel\n"
                  "cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128,\n"
                  "                 bos_token_id=0, eos_token_id=0)\n"
                  "model = GPT2LMHeadModel(cfg).cuda()\n"
                  "x = torch.randint(0, 1000, (4, 128), device='cuda')\n")
        rep = ip.run_cell_magic("gpumem", "--advise -o -q --no-chart",
                                "preds = []\nfor _ in range(4):\n    preds.append(model(x).logits)\n")
    finally:
        ip.run_line_magic("gpusim", "off")
    r = rep.advice.retained
    h = r["preds[...]"]
    assert h.tensors == 4 and h.nbytes == 4 * 4 * 128 * 1000 * 4  # the logits, fp32
    assert r.unnamed == 0, str(r)
    assert 0 < r.workspaces <= 64 << 20
    # what remains between the two: the 512-byte rounding of each storage (up), and the
    # real 8-byte CPU scalars the graphs save, in graph_bytes but not on the GPU (down)
    assert h.total + r.workspaces - 4096 <= rep.retained <= h.total + r.workspaces + 512 * 2000
    assert "held by no name" not in str(r)


def test_a_fix_that_ran_out_later_joins_the_combination_first():
    """Rows that ran out of memory have lower bounds that do not compare: checkpointing
    that reached the loss before running out (a higher bound) helped more than bf16
    weights that ran out in the third layer. The combination search takes the fixes by
    how far they got, and leaves out one that ran out sooner than the run as written."""
    from types import SimpleNamespace

    from memmagic.doctor.ranking import Strategy, _combine

    tried = []

    class Engine:
        def run(self, **knobs):
            tried.append(dict(knobs))
            fits = knobs == {"checkpointing": True, "seq_len": 2048}
            return SimpleNamespace(error=None, failed_request=None, peak=10, reserved_peak=12,
                                   fits=fits)

    base = Strategy("as written", {}, 100, None, False, "oom", True, progress=(0, 0, 40, 400))
    rows = [Strategy("activation checkpointing", {"checkpointing": True}, 130, None, False,
                     "oom", True, progress=(0, 1, 90, 500)),
            Strategy("context 2048", {"seq_len": 2048}, 98, None, False, "oom", True,
                     progress=(0, 0, 90, 900)),
            Strategy("bf16 weights", {"weights_dtype": "bf16"}, 95, None, False, "oom", True,
                     progress=(0, 0, 60, 700)),
            Strategy("AMP bf16", {"amp": "bf16"}, 90, None, False, "oom", True,
                     progress=(0, 0, 30, 300))]
    best = _combine(Engine(), base, rows)
    assert best.label == "activation checkpointing + context 2048" and best.fits
    assert tried == [{"checkpointing": True, "seq_len": 2048}]
    # AMP ran out sooner than the cell as written: never combined
    _combine(Engine(), base, rows[2:])
    assert {"amp": "bf16"} not in tried and not any("amp" in t for t in tried)


def test_a_row_that_ran_out_says_where(ip):
    """Where each re-run ran out of memory shows how far it got."""
    from memmagic.doctor.ranking import _row
    from memmagic.backends.sim import SimBackend

    out = SimBackend(gpu_memory="64MiB").execute(lambda ns: exec(
        "import torch\nw = torch.nn.Linear(4096, 4096).cuda()\n"
        "y = w(torch.randn(4096, 4096, device='cuda'))\n", ns), {})
    row = _row("as written", {}, out.report)
    assert row.out_of_memory and row.progress[:3] == (0, 0, 0)  # before any module
    assert row.reason.startswith("out of memory asking for ") and "during " in row.reason, row.reason


def test_a_row_names_the_op_that_ran_out_not_the_ops_that_ran_as_the_error_unwound():
    """An optimizer's step runs in a profiler range: its exit is an op too, run after the
    request failed; the row names the op whose request failed (as the error does)."""
    from memmagic.doctor.ranking import _row
    from memmagic.backends.sim import SimBackend

    out = SimBackend(gpu_memory="200MiB").execute(lambda ns: exec(
        "import torch\nm = torch.nn.Linear(4096, 4096).cuda()\n"
        "opt = torch.optim.AdamW(m.parameters(), foreach=True)\n"
        "m(torch.randn(8, 4096, device='cuda')).sum().backward()\nopt.step()\n", ns), {})
    failed = re.search(r"Ran out at aten\.(\w+)\.", out.report.error).group(1)
    assert failed == "zeros_like"  # AdamW's state, made at its first step
    assert out.report.trace.ops[-1][0].startswith("_record_function_exit")
    row = _row("as written", {}, out.report)
    assert f" at {failed}, during optimizer" in row.reason, row.reason


@pytest.mark.parametrize("loops", ["128 // batch_size", "2"])
def test_a_size_the_runs_cannot_read_off_is_said_so(loops):
    """llm.c's train_gpt2.py derives its accumulation count from the batch: its runs at
    batch 2, 4 and 8 make different allocations, on no line, so no largest batch between
    4 (fits) and 8 (runs out) is read off; the doctor says why, and halves the gap by runs
    (at most three where the gap is then within an eighth). With a fixed loop the line
    holds and the row is read off."""
    from memmagic.doctor.ranking import rank
    from memmagic.whatif.engine import Cell

    src = ("import torch\n"
           "batch_size = 64\n"
           f"for _ in range({loops}):\n"
           "    x = torch.randn(batch_size, 1 << 20, device='cuda', requires_grad=True)\n"
           "    (x * 2).sum().backward()\n")
    _, rows, notes = rank(Cell(src, {}, backend_options={"gpu_memory": "400MiB"}))
    said = [n for n in notes if "no largest that fits was read off" in n]
    read = [r for r in rows if "the largest that fits" in r.label]
    if loops == "2":
        assert read and not said
    else:
        assert not read and len(said) == 1
        assert "between 16, 32 (fit) and 64 (runs out)" in said[0] and "not on one line" in said[0]
        # the runs that halved the gap: 48, 40 and 36 ran out, so 32 stays the largest run
        assert said[0].startswith("batch: 32 fits and 36 runs out, found by 3 runs halving")
        assert "(48, 40, 36)" in said[0]
        assert not any(r.label.startswith(("batch 48", "batch 40", "batch 36")) for r in rows)


def test_the_largest_that_fits_is_said_of_a_run_made_before_the_halving():
    """Where every run that halves the gap runs out, the largest that fits is a batch the
    doctor ran before them (batch 4 of its 4 and 2): its row says so, once."""
    from memmagic.doctor.ranking import rank
    from memmagic.whatif.engine import Cell

    src = ("import torch\n"
           "batch_size = 8\n"
           "for _ in range(64 // batch_size):\n"
           "    x = torch.randn(batch_size, 1 << 22, device='cuda', requires_grad=True)\n"
           "    (x * 2).sum().backward()\n")
    _, rows, notes = rank(Cell(src, {}, backend_options={"gpu_memory": "200MiB"}))
    assert any(n.startswith("batch: the largest that fits is 4 (5 runs out)") for n in notes)
    batch = [r.label for r in rows if r.label.startswith("batch ")]
    assert sorted(batch) == ["batch 2 (from 8)", "batch 4 (from 8), the largest that fits"]


def test_the_largest_that_fits_is_said_of_a_re_run_the_line_reads_it_off():
    """Where the line through the re-runs reads the largest batch that fits as one the
    doctor ran (batch 4 of its 4 and 2), that row says so, once."""
    from memmagic.doctor.ranking import rank
    from memmagic.whatif.engine import Cell

    src = ("import torch\n"
           "batch_size = 8\n"
           "x = torch.randn(batch_size, 1 << 22, device='cuda', requires_grad=True)\n"
           "(x * 2).sum().backward()\n")
    cell = Cell(src, {}, backend_options={"gpu_memory": "140MiB"})
    _, rows, notes = rank(cell)
    batch = [r.label for r in rows if r.label.startswith("batch ")]
    assert sorted(batch) == ["batch 2 (from 8)", "batch 4 (from 8), the largest that fits"]
    assert ("batch 4 (from 8), the largest that fits: a re-run's, and the next does not fit "
            "by the line through the re-runs") in notes
    assert cell.run(batch_size=5).fits is False


@pytest.mark.parametrize("memory, largest", [("300MiB", 6), ("340MiB", 7)])
def test_a_gap_no_line_reads_is_halved_by_runs_to_the_largest_that_fits(memory, largest):
    """pytorch/examples' word_language_model trims its token stream to a multiple of the
    batch (on no line through the runs): the doctor's runs halve the gap between the
    largest run that fits and the smallest that ran out, one after another, and name the
    largest that fits once the gap closes, as a row of the run that found it. The row's
    figures are a run's; the batch above it runs out."""
    from memmagic.doctor.ranking import rank
    from memmagic.whatif.engine import Cell

    src = ("import torch\n"
           "batch_size = 8\n"
           "for _ in range(64 // batch_size):\n"
           "    x = torch.randn(batch_size, 1 << 22, device='cuda', requires_grad=True)\n"
           "    (x * 2).sum().backward()\n")
    cell = Cell(src, {}, backend_options={"gpu_memory": memory})
    _, rows, notes = rank(cell)
    said = [n for n in notes if "halving the gap" in n]
    assert len(said) == 1 and said[0].startswith(
        f"batch: the largest that fits is {largest} ({largest + 1} runs out)"), said
    row, = [r for r in rows if "the largest that fits" in r.label]
    assert row.label == f"batch {largest} (from 8), the largest that fits" and row.fits
    assert (row.peak, row.fits) == (cell.run(batch_size=largest).peak, True)
    assert cell.run(batch_size=largest + 1).fits is False


def _asserting_loop(batch: int) -> str:
    """A loop of 64 samples in batches of ``batch_size``, 16 MiB a sample, that asserts its
    batch divides them (as llm.c's train_gpt2.py asserts of its total batch)."""
    return ("import torch\n"
            f"batch_size = {batch}\n"
            "assert 64 % batch_size == 0\n"
            "for _ in range(64 // batch_size):\n"
            "    x = torch.randn(batch_size, 1 << 22, device='cuda', requires_grad=True)\n"
            "    (x * 2).sum().backward()\n")


def test_a_halving_the_script_refuses_says_why_it_stopped():
    """karpathy/llm.c's train_gpt2.py asserts that its total batch is a multiple of the
    micro-batch: where the halving's size fails that ``assert`` (no message), the doctor's
    note says the run could not be measured, and where the script stopped, not only that
    the gap stays open (a cell made here has no source for the line to show; a script's
    and a notebook's have: tests/frontends/test_cli.py)."""
    from memmagic.doctor.ranking import rank
    from memmagic.whatif.engine import Cell

    cell = Cell(_asserting_loop(8), {}, backend_options={"gpu_memory": "300MiB"})
    _, rows, notes = rank(cell)
    said, = [n for n in notes if "halving the gap" in n]
    assert said.startswith("batch: 4 fits and 8 runs out, found by 1 run halving the gap one "
                           "after another (6); the run at 6 could not be measured (failed: "
                           "AssertionError at line 3): "), said
    assert cell.run(batch_size=6).error == "AssertionError at line 3"


def test_the_largest_run_that_fits_is_a_row_where_the_halving_cannot_close_the_gap():
    """Batch 16 where 8 and 4 run out and 2 fits, and 3 (the halving) fails the script's
    own ``assert``: the gap stays open, and batch 2, which the doctor ran for its line and
    which fits, is a row of the table (a notebook's LoRA loop showed only the rows that did
    not fit), with its run's figures and no claim to be the largest."""
    from memmagic.doctor.ranking import rank
    from memmagic.whatif.engine import Cell

    cell = Cell(_asserting_loop(16), {}, backend_options={"gpu_memory": "150MiB"})
    _, rows, notes = rank(cell)
    batch = {r.label: r for r in rows if r.label.startswith("batch ")}
    assert sorted(batch) == ["batch 2 (from 16)", "batch 4 (from 16)", "batch 8 (from 16)"]
    two = batch["batch 2 (from 16)"]
    assert two.fits and two.peak == cell.run(batch_size=2).peak
    assert not batch["batch 4 (from 16)"].fits and not batch["batch 8 (from 16)"].fits
    said, = [n for n in notes if "halving the gap" in n]
    assert said.startswith("batch: 2 fits and 4 runs out"), said
