"""Forward passes with gradients off that repeat, evaluated on the allocator model instead of
run op by op (issue 39, item 4: evaluation loops in the doctor's re-runs).

:mod:`memmagic.backends.sim.repeats`: each case runs both ways (``decode="run"`` runs every
call) and must leave the same allocator log, entry by entry, the same peaks and breakdown.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from memmagic.backends.sim import SimBackend
from memmagic.whatif.plane import allocation_shape

MODEL = """\
import torch, torch.nn as nn, torch.nn.functional as F

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc, self.proj = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))

class Net(nn.Module):
    def __init__(self, d=64, n=2, vocab=100):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)
{extra_init}
    def forward(self, idx, targets=None):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
{extra_forward}
        logits = self.head(x)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

model = Net().cuda()
opt = torch.optim.AdamW(model.parameters())
"""
EVAL_LOOP = """\
@torch.no_grad()
def evaluate(n):
    model.eval()
    losses = torch.zeros(n)
    for k in range(n):
        x = torch.randint(0, 100, (8, 32), device="cuda")
        with {ctx}:
            logits, loss = model(x, x)
        losses[k] = loss.item()
    model.train()
    return losses

evaluate({n})
x = torch.randint(0, 100, (8, 32), device="cuda")
logits, loss = model(x, x)
loss.backward()
opt.step()
evaluate({n})
"""


def cell(n: int = 40, ctx: str = "torch.autocast('cuda', dtype=torch.float16)",
         extra_init: str = "", extra_forward: str = "", loop: str = EVAL_LOOP) -> str:
    return (MODEL.format(extra_init=extra_init, extra_forward=extra_forward)
            + loop.format(n=n, ctx=ctx))


def simulate(src: str, decode_steps: str = "evaluate", **options):
    code = compile(textwrap.dedent(src), "<cell>", "exec")
    backend = SimBackend(**{"gpu": "T4", "decode": decode_steps, **options})
    return backend.execute(lambda n: exec(code, n), {})


def log_of(report) -> list[tuple]:
    """The allocator log, its keys numbered by first use (the evaluated calls' buffers
    have keys of their own), each run of frees in key order: autocast frees its cached
    weight casts in the order of its hash map (the addresses of the weights), which the
    same frees in any order leave the allocator as they found it."""
    ids: dict = {}
    out: list[tuple] = []
    frees: list[tuple] = []
    for e in report.trace.allocator_log.entries:
        entry = (e["action"], e.get("size"),
                 None if e.get("key") is None else ids.setdefault(e["key"], len(ids)))
        if e["action"].startswith("free_"):
            frees.append(entry)
            continue
        out += sorted(frees, key=lambda f: (f[2], f[0]))
        frees = []
        out.append(entry)
    return out + sorted(frees, key=lambda f: (f[2], f[0]))


def note_of(report) -> str | None:
    return next((str(n) for n in report.notes if "with gradients off" in str(n)
                 and "evaluated" in str(n)), None)


def both(src: str, **options):
    evaluated, ran = simulate(src, **options), simulate(src, "run", **options)
    assert evaluated.error is None and ran.error is None, (evaluated.error, ran.error)
    a, b = evaluated.report, ran.report
    assert log_of(a) == log_of(b)
    # the tracker's events too: what the what-if planes and the doctor's lines fit
    assert allocation_shape(a) == allocation_shape(b)
    for field in ("peak", "reserved_peak", "reserved_after", "retained", "host_peak"):
        assert getattr(a, field) == getattr(b, field), field
    assert a.breakdown == b.breakdown
    assert a.peak_module == b.peak_module and a.peak_op == b.peak_op
    assert note_of(b) is None
    return a, b


@pytest.mark.parametrize("ctx", ["torch.autocast('cuda', dtype=torch.float16)",
                                 "torch.autocast('cuda', dtype=torch.float16, cache_enabled=False)",
                                 "torch.no_grad()", "torch.inference_mode()"])
def test_evaluated_calls_do_what_running_them_does(ctx):
    a, b = both(cell(ctx=ctx))
    note = note_of(a)
    # two calls agree, 16 are evaluated, one checks, the last of the 40... (the first loop
    # runs before training: its first call also makes cuBLAS's workspace)
    assert note is not None and "(Net) were evaluated, not run" in note, note
    evaluated = int(note.split()[0])
    assert 60 <= evaluated <= 76, note
    assert "ran op by op as checks and did the same" in note
    # their ops did not run
    assert len(a.trace.ops) < len(b.trace.ops) - evaluated * 10


def test_the_output_keeps_its_structure_and_shapes():
    src = cell(n=6, loop="""\
model.eval()
with torch.no_grad():
    for k in range(6):
        x = torch.randint(0, 100, (4, 16), device="cuda")
        out = model(x)
        # (an evaluated call's output too: both() fails on an error)
        assert type(out) is tuple and out[1] is None, out
        assert out[0].shape == (4, 16, 100) and out[0].dtype == torch.float32
        assert out[0].device.type == "cuda" and not out[0].requires_grad
        del out
""")
    a, _ = both(src)
    assert "3 forward passes" in note_of(a)


def test_calls_that_raise_the_peak_run():
    """Outputs kept in a list: each call holds more than the one before, so each sets the
    run's peak and runs (the peak keeps its op and module)."""
    src = cell(n=12, loop="""\
model.eval()
keep = []
with torch.no_grad():
    for k in range(12):
        x = torch.randint(0, 100, (8, 32), device="cuda")
        keep.append(model(x)[0])
""")
    a, _ = both(src)
    assert note_of(a) is None


@pytest.mark.parametrize("extra_init,extra_forward,why", [
    ("", "        if x.sum() > 0:\n            x = x * 2\n", "reads tensor values"),
    # the attribute held the only reference to the last call's tensor: each call frees it
    ("", "        self.last = x\n", "frees memory made before it"),
    ("        self.seen = 0\n",
     "        if 'seen' in vars(self):\n            del self.seen\n        else:\n"
     "            self.seen = 0\n", "removes an attribute"),
    ("        self.seen = []\n", "        self.seen.append(x)\n", "keeps memory past its call"),
])
def test_calls_that_may_differ_all_run(extra_init, extra_forward, why, monkeypatch):
    from memmagic.backends.sim import repeats

    said: list[str] = []  # why each call that could not repeat could not

    class Recorded(repeats._NotRepeatable):
        def __init__(self, reason: str) -> None:
            said.append(reason)
            super().__init__(reason)
    monkeypatch.setattr(repeats, "_NotRepeatable", Recorded)
    note = repeats._Repeats.note  # (and the reason autocast's exit finds: a kept cast)
    monkeypatch.setattr(repeats._Repeats, "note",
                        lambda self: said.extend(self.reasons.values()) or note(self))
    a, _ = both(cell(n=8, extra_init=extra_init, extra_forward=extra_forward))
    assert note_of(a) is None
    assert any(why in reason for reason in said), said


def test_an_attribute_set_to_a_new_tensor_is_set_by_an_evaluated_call_too():
    """llama2.c's forward keeps its loss in ``self.last_loss`` and returns the logits; the
    loop reads the attribute and holds it until the next call's: an evaluated call makes
    the new tensor and sets the attribute, as the calls that ran did."""
    src = cell(n=24, extra_forward="""\
        self.last_loss = x.float().mean() if targets is not None else None
""", loop="""\
model.eval()
with torch.no_grad():
    for k in range(24):
        x = torch.randint(0, 100, (8, 32), device="cuda")
        logits, _ = model(x, x)
        loss = model.last_loss
        assert loss.shape == () and loss.dtype == torch.float32 and loss.device.type == "cuda"
        assert logits.shape == (8, 32, 100)
    model(x)
    assert model.last_loss is None
""")
    a, _ = both(src)
    note = note_of(a)
    assert note is not None and int(note.split()[0]) >= 16, note


def test_hooks_and_gradients_run_every_call():
    hooked = cell(n=8, loop="""\
seen = []
model.head.register_forward_hook(lambda m, i, o: seen.append(o.shape))
model.eval()
with torch.no_grad():
    for k in range(8):
        model(torch.randint(0, 100, (8, 32), device="cuda"))
assert len(seen) == 8
""")
    a, _ = both(hooked)
    assert note_of(a) is None
    with_grad = cell(n=8, loop="""\
for k in range(8):
    model(torch.randint(0, 100, (8, 32), device="cuda"))[0].sum()
""")
    a, _ = both(with_grad)
    assert note_of(a) is None


def test_a_check_that_fails_is_said(monkeypatch):
    """A call that runs as a check and does not do what the calls before did (here: made
    to disagree) is said in the note; its kind runs until two calls agree again."""
    import dataclasses

    from memmagic.backends.sim import repeats

    ran = repeats._Repeats._ran
    spoiled = []

    def spoil(self, kind, done):
        if kind.line is not None and kind.left <= 0 and kind.evaluated and not spoiled:
            spoiled.append(kind.evaluated)
            done = dataclasses.replace(done, sizes=done.sizes[:-1] + (done.sizes[-1] + 512,))
        return ran(self, kind, done)

    monkeypatch.setattr(repeats._Repeats, "_ran", spoil)
    out = simulate(cell(n=40, ctx="torch.no_grad()"))
    note = note_of(out.report)
    assert spoiled == [16]
    assert "1 check did NOT do what the calls before did" in note, note


def test_the_run_puts_torch_back():
    from memmagic.core import _torch_private as priv

    cls, slot = priv.module_call_slot()
    before, clear = getattr(cls, slot), torch.clear_autocast_cache
    out = simulate(cell(n=20))
    assert out.error is None
    assert getattr(cls, slot) is before and torch.clear_autocast_cache is clear
    err = simulate(cell(n=20) + "raise KeyboardInterrupt\n")
    assert isinstance(err.error, KeyboardInterrupt) or err.error is not None
    assert getattr(cls, slot) is before and torch.clear_autocast_cache is clear


def test_an_evaluation_loop_that_runs_out_of_memory_fails_as_its_own():
    src = cell(n=30, ctx="torch.no_grad()").replace("(8, 32)", "(512, 512)")
    evaluated = simulate(src, gpu=None, gpu_memory="700MiB")
    ran = simulate(src, "run", gpu=None, gpu_memory="700MiB")
    assert "out of memory" in str(ran.error)
    assert str(evaluated.error) == str(ran.error)
    assert log_of(evaluated.report) == log_of(ran.report)


def test_autocast_around_the_whole_loop_caches_its_casts_once():
    """Autocast entered once around the loop: the first call casts the weights (kept in
    autocast's cache until it exits), the next ones reuse them and repeat each other."""
    src = cell(n=30, loop="""\
model.eval()
with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16):
    for k in range(30):
        x = torch.randint(0, 100, (8, 32), device="cuda")
        logits, loss = model(x, x)
""")
    a, _ = both(src)
    note = note_of(a)
    assert note is not None and int(note.split()[0]) >= 24, note
