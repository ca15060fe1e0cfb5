"""The what-if engine: a cell re-run under knobs returns a MemoryReport; knobs applied by
the cell itself and by memmagic; the namespace and torch's global state left as found."""

from __future__ import annotations

import gc

import pytest
import torch

from memmagic import zoo
from memmagic.whatif.engine import Cell, KnobError, Setting

from conftest import global_state

# reads batch_size and checkpointing itself; memmagic applies every other knob
HANDLES = """
import torch
from memmagic import zoo
model, _ = zoo.build("transformer", device="cuda", checkpointing=checkpointing)
x = torch.randint(1000, (batch_size, 128), device="cuda")
opt = torch.optim.AdamW(model.parameters())
loss = model.loss(x, x)
loss.backward()
opt.step()
"""
# reads nothing: memmagic applies checkpointing by wrapping the model's blocks
PLAIN = HANDLES.replace("checkpointing=checkpointing", "checkpointing=False").replace(
    "(batch_size, 128)", "(8, 128)")
# handles accumulation itself
ACCUM = """
import torch
from memmagic import zoo
model, _ = zoo.build("transformer", device="cuda")
opt = torch.optim.AdamW(model.parameters())
for _ in range(accum_steps):
    x = torch.randint(1000, (batch_size // accum_steps, 128), device="cuda")
    model.loss(x, x).backward()
opt.step()
"""


def act(r):
    return r.breakdown["activations"]


@pytest.fixture(scope="module")
def cell():
    return Cell(HANDLES, {}, defaults={"batch_size": 8})


def test_the_cell_reads_its_knob_variables(cell):
    assert cell.reads == {"batch_size", "checkpointing"}
    assert cell.baseline == Setting(batch_size=8)


def test_larger_batch_raises_the_peak(cell):
    assert cell.run(batch_size=32).peak > 2 * cell.run().peak


def test_amp_lowers_activations_on_a_transformer(cell):
    base, amp = cell.run(batch_size=16), cell.run(batch_size=16, amp="fp16")
    assert act(amp) < 0.8 * act(base)
    assert any("GradScaler" in n for n in amp.notes)


def test_checkpointing_handled_by_the_cell_lowers_activations(cell):
    base, ckpt = cell.run(batch_size=16), cell.run(batch_size=16, checkpointing=True)
    assert act(ckpt) < 0.5 * act(base) and ckpt.peak < base.peak
    assert any("handled by the cell itself: batch_size, checkpointing" in n for n in ckpt.notes)


def test_checkpointing_applied_by_memmagic_wraps_the_blocks():
    c = Cell(PLAIN, {})
    assert c.reads == frozenset()
    base, ckpt = c.run(), c.run(checkpointing=True)
    assert act(ckpt) < 0.5 * act(base)
    assert any("2 block(s) (TransformerBlock)" in n for n in ckpt.notes)
    # and the same number as the cell that checkpoints itself
    assert ckpt.peak == Cell(HANDLES, {}).run(batch_size=8, checkpointing=True).peak


def test_accumulation_at_a_fixed_effective_batch_lowers_the_peak():
    c = Cell(ACCUM, {}, defaults={"batch_size": 32})
    one, four = c.run(), c.run(accum_steps=4)
    assert four.peak < 0.6 * one.peak
    # kept gradients: more than a single micro-batch step alone
    micro = c.run(batch_size=8)
    assert four.peak >= micro.peak


def test_fp16_weights_halve_the_parameters(cell):
    base, half = cell.run(), cell.run(weights_dtype="fp16")
    assert half.breakdown["parameters"] * 2 == base.breakdown["parameters"]


def test_optimizer_knob_swaps_the_optimizer_the_cell_builds(cell):
    sgd, adam = cell.run(optimizer="sgd", amp="bf16"), cell.run(amp="bf16")
    assert any("AdamW built by the cell replaced by SGD" in n for n in sgd.notes)
    assert sgd.peak < adam.peak


def test_no_grad_forward_holds_no_activations_or_gradients(cell):
    r = cell.run(grad_mode="no_grad")
    assert r.error is None and act(r) == 0 and r.breakdown["gradients"] == 0


def test_offload_moves_saved_activations_to_the_host(cell):
    base, off = cell.run(batch_size=32), cell.run(batch_size=32, offload=True)
    assert off.peak < base.peak and off.host_peak > base.host_peak


def test_gpu_knob_gives_a_verdict(cell):
    assert cell.run(gpu="T4").fits is True
    r = cell.run(gpu="laptop-4GB", batch_size=2048)
    assert r.fits is False and r.error and "out of memory" in r.error


def test_engine_accumulation_on_a_model_of_an_earlier_cell():
    model, batch = zoo.build("mlp", "cpu")
    ns = {"model": model, "batch": batch, "opt": torch.optim.Adam(model.parameters()),
          "torch": torch}
    c = Cell("model.loss(*batch).backward()\nopt.step()\nopt.zero_grad()\n", ns, backend="cpu")
    assert c.baseline.batch_size == 64 and c.reads == frozenset()
    full = c.run(batch_size=512)
    acc = c.run(batch_size=512, accum_steps=8)
    assert acc.peak < full.peak
    assert any("ran 8 times on micro-batches of 64" in n for n in acc.notes)
    assert "accum_steps" in c.applicable()


@pytest.mark.parametrize("container", ["torch.nn.ModuleList", "list"])
def test_accumulation_applies_to_a_step_that_loops_over_its_layers(container):
    """``for layer in layers: h = layer(h)``: the loop variable names a layer that existed
    before the cell (inside a ModuleList, or a plain list), not a model the cell built, so
    the accumulation control stays."""
    layers = eval(container)([torch.nn.Linear(64, 64) for _ in range(3)])
    params = [p for layer in layers for p in layer.parameters()]
    ns = {"layers": layers, "x": torch.randn(32, 64), "opt": torch.optim.SGD(params, lr=0.1),
          "torch": torch}
    c = Cell("h = x\nfor layer in layers:\n    h = layer(h).relu()\nh.sum().backward()\n"
             "opt.step()\nopt.zero_grad()\n", ns, backend="cpu")
    assert "accum_steps" in c.applicable()
    r = c.run(batch_size=32, accum_steps=4)
    assert r.error is None and any("ran 4 times on micro-batches of 8" in n for n in r.notes)


def test_engine_accumulation_refuses_a_cell_that_builds_its_model():
    c = Cell(PLAIN, {}, defaults={"batch_size": 8})
    assert "accum_steps" not in c.applicable()


def test_a_batch_the_cell_cannot_size_is_a_knob_error():
    r = Cell("import torch\nx = torch.ones(4, device='cuda')\n", {}).run(batch_size=8)
    assert "does not read batch_size" in r.error


def test_the_namespace_is_left_as_found(clean_state):
    ns = {"keep": 1, "batch_size": 3}
    c = Cell("import torch\ny = torch.ones(batch_size, device='cuda')\nkeep = 2\n", ns)
    assert c.baseline.batch_size == 3
    c.run(batch_size=8, amp="bf16", checkpointing=True)
    assert ns.keys() - {"__builtins__"} == {"keep", "batch_size"}
    assert ns["keep"] == 1 and ns["batch_size"] == 3


def test_a_failing_cell_restores_global_state_and_reports_the_error(clean_state):
    c = Cell(PLAIN + "raise ValueError('at the end')\n", {})
    r = c.run(amp="fp16", checkpointing=True, weights_dtype="bf16")
    assert r.error and "at the end" in r.error


def test_a_function_cell_gets_its_knobs_as_arguments():
    def step(batch_size, amp=None):
        x = torch.randn(batch_size, 256, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=amp, enabled=amp is not None):
            y = torch.nn.functional.linear(x, torch.ones(256, 256, device="cuda"))
        y.sum().backward()

    c = Cell(step, defaults={"batch_size": 8})
    assert c.reads == {"batch_size", "amp"}
    assert c.run(batch_size=64).peak > c.run().peak


def test_re_runs_leak_nothing():
    c = Cell(HANDLES, {}, defaults={"batch_size": 8})
    c.run()
    gc.collect()
    tensors = _count_tensors()
    for i in range(6):
        c.run(batch_size=8 << (i % 3), amp=("off", "fp16")[i % 2], checkpointing=bool(i % 3))
    gc.collect()
    assert _count_tensors() <= tensors


def _count_tensors() -> int:
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def test_assigned_names_are_the_module_scope_bindings_only():
    from memmagic.whatif.engine import assigned_names

    src = ("x = 1\nfor i in range(3):\n    y = i\nps = [p for p in range(3)]\n"
           "def f(a):\n    z = a\nwith open('f') as fh:\n    pass\na, (b, c) = 1, (2, 3)\n")
    assert assigned_names(src) == {"x", "i", "y", "ps", "f", "fh", "a", "b", "c"}
    assert assigned_names("x = (") == {"x"}  # a regex guess where it does not parse


def test_a_batch_size_the_cell_sets_once_is_a_knob_set_where_it_stands(clean_state):
    """``batch_size = 64`` written once in the cell itself: the cell takes the batch knob
    there (a run at another size runs the cell with that number replaced, its other lines
    as they are), and the doctor tries smaller batches."""
    from memmagic.doctor.ranking import rank

    src = ("import torch\n"
           "batch_size = 64  # set here, once\n"
           "x = torch.randn(batch_size, 1 << 20, device='cuda', requires_grad=True)\n"
           "(x * 2).sum().backward()\n")
    ns: dict = {}
    c = Cell(src, ns, backend_options={"gpu_memory": "400MiB"})
    assert c.reads == {"batch_size"} and c.baseline == Setting(batch_size=64)
    full, small = c.run(), c.run(batch_size=16)
    assert full.failed_request is not None and small.fits  # 64 x 4 MiB does not fit
    assert any("batch_size 16: set where the cell sets it (line 2: batch_size = 64 as written)"
               in str(n) for n in small.notes)
    assert ns.keys() <= {"__builtins__"}  # the namespace as it was
    _, rows, notes = rank(c)
    assert any(r.label.startswith("batch ") and r.fits for r in rows), rows
    assert not any("no smaller batch was tried" in n for n in notes)
    # set with another size from numbers written out: each a knob where it stands
    pair = Cell(src.replace("batch_size = 64", "batch_size, width = 64, 1 << 20")
                .replace("1 << 20, device", "width, device"), {},
                backend_options={"gpu_memory": "400MiB"})
    assert pair.reads == {"batch_size"} and pair.run(batch_size=16).fits
    # set twice, or computed: the cell's own value, not a knob
    for src2 in (src.replace("# set here, once", "\nbatch_size = 32"),
                 src.replace("batch_size = 64", "batch_size = 8 * 8")):
        assert "batch_size" not in Cell(src2, {}).reads


def test_a_batch_size_passed_to_an_earlier_cells_function_is_a_knob_where_it_stands(
        clean_state):
    """A notebook's ``def step(batch_size)`` in an earlier cell, then ``loss = step(512)``:
    the number is where the cell sets the batch (a ViT notebook ran out of memory there and
    the doctor tried no smaller batch); a run at another size passes that number, the
    namespace's names are left as they were, and the doctor tries smaller batches."""
    from memmagic.doctor.ranking import rank

    ns: dict = {}
    exec("import torch\n"
         "def step(batch_size, width=1 << 20):\n"
         "    x = torch.randn(batch_size, width, device='cuda', requires_grad=True)\n"
         "    (x * 2).sum().backward()\n"
         "    return x.shape[0]\n", ns)
    c = Cell("n = step(64)\n", ns, backend_options={"gpu_memory": "400MiB"})
    assert c.reads == {"batch_size"} and c.baseline == Setting(batch_size=64)
    small = c.run(batch_size=16)
    assert small.fits and any("batch_size 16: set where the cell sets it (line 1: step(64) as "
                              "written)" in str(n) for n in small.notes)
    assert "n" not in ns
    _, rows, notes = rank(c)
    assert any(r.label.startswith("batch ") and r.fits for r in rows), rows
    assert not any("no smaller batch was tried" in n for n in notes)
    # a function of the cell's own name binding, or a class: not the namespace's function
    assert "batch_size" not in Cell("step = print\nstep(64)\n", ns).reads


def test_a_cell_takes_its_card_as_fit_map_does():
    """``Cell(code, gpu="T4")`` names the card as ``fit_map(cell, gpu="T4")`` does (a user
    wrote it so and got "unexpected keyword argument 'gpu'"); named twice, differently, it
    is one line that says what to do."""
    src = "import torch\nx = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')\n"
    assert Cell(src, {}, gpu="T4").run().gpu_name == "T4"
    assert Cell(src, {}, gpu="T4", backend_options={"gpu": "T4"}).backend_options == {"gpu": "T4"}
    with pytest.raises(ValueError, match="give the card once"):
        Cell(src, {}, gpu="T4", backend_options={"gpu": "A100-40GB"})
