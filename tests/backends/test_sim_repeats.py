"""Forward passes with gradients off that repeat, evaluated on the allocator model instead of
run op by op (issue 39, item 4: evaluation loops in the doctor's re-runs).

:mod:`memmagic.backends.sim.repeats`: each case runs both ways (``decode="run"`` runs every
call) and must leave the same allocator log, entry by entry, the same peaks and breakdown.
"""

from __future__ import annotations

import re
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


def test_calls_that_all_ran_say_why_once_there_are_many():
    """x-transformers' generate() calls its model 1,024 times with a LayerIntermediates in
    and out, and none can be evaluated: the script took 48 s with no word on why. From 32
    calls that all ran, a note names each model and why (fewer: no note, as above)."""
    reads = "        if x.sum() > 0:\n            x = x * 2\n"
    a = simulate(cell(n=20, extra_forward=reads)).report  # 2 x 20 evaluation calls
    note = note_of(a)
    assert note is not None and note.startswith(
        "40 forward passes with gradients off ran op by op, none evaluated from the calls "
        "before it (Net: it reads tensor values into Python"), note
    assert note_of(simulate(cell(n=15, extra_forward=reads)).report) is None


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


# -- calls whose sizes grow: decode loops --------------------------------------------------------
GENERATE = """\
import torch.nn.functional as F

@torch.no_grad()
def generate(idx, n):
    model.eval()
    for _ in range(n):
        logits, _ = model(idx)
        probs = F.softmax(logits[:, -1, :], dim=-1)
        idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
    return idx

out = generate(torch.zeros((2, 1), dtype=torch.long, device="cuda"), {n})
assert out.shape == (2, {n} + 1)
"""
# scores over the tokens so far: sizes that grow with the square of the context
SCORES = "        x = (x @ x.transpose(1, 2)).softmax(-1) @ x\n"


def grew_note(report) -> str | None:
    note = note_of(report)
    return note if note and "whose sizes grew at each call" in note else None


@pytest.mark.parametrize("extra_forward", ["", SCORES], ids=["linear", "quadratic"])
def test_a_decode_loop_without_a_cache_is_evaluated_as_running_it_would(extra_forward):
    """nanoGPT's and minGPT's ``generate``: the model is called on all the tokens so far,
    one more each time. Four calls in a row draw the curve, the next ones are evaluated,
    and the run's peak, reached in the last call, keeps the op and module of the calls
    that ran."""
    a, b = both(cell(n=60, loop=GENERATE, extra_forward=extra_forward))
    note = grew_note(a)
    assert note is not None, note_of(a)
    grown = re.search(r"(\d+) forward passes with gradients off \(Net\) whose sizes grew", note)
    assert grown and 45 <= int(grown[1]) <= 56, note
    assert "ran op by op as checks and did the same" in note
    assert a.peak_module == b.peak_module is not None and a.peak_phase == b.peak_phase
    assert len(a.trace.ops) < len(b.trace.ops) // 3


def test_a_model_told_its_position_is_evaluated_as_running_it_would():
    """Meta's Llama reference: the model keeps its cache in a buffer and is told where the
    new token goes (``start_pos``); its attention reads the cache up to there."""
    src = MODEL.format(extra_init="", extra_forward="") + """\
class Cached(nn.Module):
    def __init__(self, d=64, most=128):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.register_buffer("cache", torch.zeros(2, most, d))

    def forward(self, x, start_pos):
        t = x.shape[1]
        self.cache[:, start_pos:start_pos + t] = self.q(x)
        keys = self.cache[:, :start_pos + t]
        return (x @ keys.transpose(1, 2)).softmax(-1) @ keys

m = Cached().cuda()
x = torch.randn(2, 1, 64, device="cuda")
with torch.no_grad():
    for pos in range(100):
        y = m(x, pos)
"""
    a, _ = both(src)
    note = grew_note(a)
    assert note is not None and "(Cached) whose sizes grew" in note, note_of(a)


def test_a_decode_loop_that_stops_growing_goes_on_without_a_failed_check():
    """nanoGPT's ``generate`` crops the tokens to the block size: from there the calls stop
    growing (their inputs leave the curve: no check failed) and repeat each other."""
    src = cell(n=60, loop=GENERATE.replace("logits, _ = model(idx)",
                                           "logits, _ = model(idx[:, -24:].contiguous())"))
    a, _ = both(src)
    note = note_of(a)
    assert note is not None and "were evaluated, not run" in note, note
    assert "whose sizes grew at each call" in note and "did NOT" not in note, note


def test_a_decode_loop_whose_calls_change_is_said():
    """A model that takes another path past 30 tokens (Python the evaluated calls do not
    run): the check after it does not do what the curve says, the note says so, and the
    calls run until a new curve holds."""
    extra = "        if x.shape[1] > 30:\n            x = x * 2\n"
    src = cell(n=80, loop=GENERATE, extra_forward=extra)
    out = simulate(src)
    assert out.error is None
    note = grew_note(out.report)
    assert note is not None and "did NOT do what the calls before did" in note, note
