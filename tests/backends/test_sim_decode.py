"""generate()'s decode steps read off a line instead of run op by op (issue 39, item 3).

:mod:`memmagic.backends.sim.decode`: three decode steps run, the next ones are evaluated
(their allocations done on the allocator model, the cache and logits they leave made as
simulated tensors), the last one runs as a check. Each case is run both ways
(``decode="run"`` simulates every step) and must leave the same allocator log, entry by
entry, the same peaks and the same breakdown. Tiny models from configs: nothing is
downloaded.
"""

from __future__ import annotations

import gc
import textwrap

import pytest

from memmagic.backends.sim import SimBackend, SimSession
from memmagic.core.snapshot import key_frames

transformers = pytest.importorskip("transformers")

from memmagic.backends.sim import decode  # noqa: E402

MODELS = {
    "llama": """\
import torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=512)
model = LlamaForCausalLM(cfg).to("cuda", torch.float16).eval()
""",
    "gpt2": """\
import torch
from transformers import GPT2Config, GPT2LMHeadModel
cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=512)
model = GPT2LMHeadModel(cfg).to("cuda").eval()
""",
}
GENERATE = """\
ids = torch.randint(0, 256, ({batch}, 10), device="cuda")
out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens={tokens},
                     min_new_tokens={tokens}, do_sample={sample}, pad_token_id=0{extra})
"""


def cell(model: str, tokens: int = 24, batch: int = 2, sample: bool = False, extra: str = "") -> str:
    return MODELS[model] + GENERATE.format(batch=batch, tokens=tokens, sample=sample, extra=extra)


def simulate(src: str, decode_steps: str = "evaluate", ns: dict | None = None, **options):
    code = compile(textwrap.dedent(src), "<cell>", "exec")
    backend = SimBackend(**{"gpu": "T4", "decode": decode_steps, **options})
    return backend.execute(lambda n: exec(code, n), {} if ns is None else ns)


def log_of(report) -> list[tuple]:
    """The allocator log, its keys numbered by first use (the evaluated steps' buffers
    have keys of their own)."""
    ids: dict = {}
    return [(e["action"], e.get("size"),
             None if e.get("key") is None else ids.setdefault(e["key"], len(ids)))
            for e in report.trace.allocator_log.entries]


def decode_note(report) -> str | None:
    return next((str(n) for n in report.notes if "decode step" in str(n)), None)


def both(src: str, **options):
    evaluated = simulate(src, **options)
    ran = simulate(src, "run", **options)
    return evaluated, ran


def assert_same(evaluated, ran) -> None:
    a, b = evaluated.report, ran.report
    assert log_of(a) == log_of(b)
    for field in ("peak", "reserved_peak", "reserved_after", "retained", "host_peak"):
        assert getattr(a, field) == getattr(b, field), field
    assert a.breakdown == b.breakdown
    assert decode_note(b) is None


@pytest.mark.parametrize("model,sample,extra", [
    ("llama", False, ""), ("gpt2", True, ""),
    # a static cache: written in place (only the logits are left), get_seq_length() reads values
    ("llama", False, ', cache_implementation="static"')])
def test_evaluated_steps_do_what_running_them_does(model, sample, extra):
    evaluated, ran = both(cell(model, sample=sample, extra=extra))
    assert evaluated.error is None and ran.error is None
    assert_same(evaluated, ran)
    note = decode_note(evaluated.report)
    # 24 new tokens: the prefill and 23 decode steps (cache lengths 10-32); three draw the
    # line, 16 are evaluated, one runs as a check, two more are evaluated, the last checks
    assert note.startswith("generate(): 18 of its 23 decode steps were evaluated, not run "
                           "(cache lengths 13-31)"), note
    assert "checked byte for byte by a third (the steps at 10, 11 and 12)" in note
    assert note.endswith("2 steps ran op by op as checks (at cache lengths 29, 32) and did "
                         "what the line says")
    # the 19 evaluated steps' ops did not run (a step of these 2-layer models runs 50-100)
    assert len(evaluated.report.trace.ops) < len(ran.report.trace.ops) - 19 * 40


def test_an_encoder_decoder_passes_its_encoder_output_through():
    """T5: each decode step's output holds the encoder's output it was given (not made by
    the step); evaluated steps pass on the one they are given."""
    src = """\
import torch
from transformers import T5Config, T5ForConditionalGeneration
cfg = T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, vocab_size=256,
               decoder_start_token_id=0, pad_token_id=0)
model = T5ForConditionalGeneration(cfg).to("cuda").eval()
""" + GENERATE.format(batch=2, tokens=24, sample=False, extra="")
    evaluated, ran = both(src)
    assert evaluated.error is None and ran.error is None
    assert_same(evaluated, ran)
    # the decoder starts from one token: steps at cache lengths 1-23
    assert "18 of its 23 decode steps were evaluated, not run (cache lengths 4-22)" in \
        decode_note(evaluated.report)


def test_a_lora_model_generates_the_same_way():
    pytest.importorskip("peft")
    src = MODELS["llama"] + """\
from peft import LoraConfig, get_peft_model
model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
""" + GENERATE.format(batch=1, tokens=16, sample=False, extra="")
    evaluated, ran = both(src)
    assert evaluated.error is None and ran.error is None
    assert_same(evaluated, ran)
    assert "11 of its 15 decode steps were evaluated" in decode_note(evaluated.report)


def test_a_step_the_line_says_runs_out_of_memory_runs_and_fails_as_its_own():
    """A card the cache outgrows: the step that fails is run, op by op; the error, the
    failed request and the whole log are the ones of a run of every step."""
    src = MODELS["gpt2"].replace("n_layer=2, n_embd=64", "n_layer=4, n_embd=512") \
        + GENERATE.format(batch=8, tokens=400, sample=False, extra="")
    evaluated, ran = both(src, gpu=None, gpu_memory="96MiB")
    assert "out of memory" in str(ran.error)
    assert str(evaluated.error) == str(ran.error)
    assert evaluated.report.failed_request == ran.report.failed_request
    assert_same(evaluated, ran)
    note = decode_note(evaluated.report)
    assert "decode steps were evaluated" in note
    assert "then steps ran op by op (the line says the step at cache length" in note
    assert note.endswith("runs out of memory)")


def test_a_check_that_fails_starts_a_new_line(monkeypatch):
    """A step that runs as a check and does not do what the line says (here: made to
    disagree) is said in the note, and the next steps draw a new line."""
    agrees = decode._Line.matches
    monkeypatch.setattr(decode._Line, "matches",
                        lambda line, step: step.length != 29 and agrees(line, step))
    evaluated, ran = both(cell("gpt2", tokens=40))
    assert_same(evaluated, ran)
    note = decode_note(evaluated.report)
    # cache lengths 10-48: 13-28 evaluated, 29 fails and with 30 and 31 draws a new line,
    # 32-47 evaluated, 48 checks
    assert "32 of its 39 decode steps" in note, note
    assert "(the steps at 10, 11 and 12; 29, 30 and 31)" in note
    assert "1 step ran op by op as a check (at cache length 48)" in note
    assert "the check at 29 did NOT do what the line says" in note


def test_a_sliding_window_cache_is_read_off_until_it_fills():
    """Mistral's sliding-window layers keep their last W - 1 positions as views of a longer
    tensor: steps are read off until the one before the window fills, then run."""
    src = """import torch
from transformers import MistralConfig, MistralForCausalLM
cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                    max_position_embeddings=512, sliding_window=40)
model = MistralForCausalLM(cfg).to("cuda").eval()
""" + GENERATE.format(batch=1, tokens=48, sample=False, extra="")
    evaluated, ran = both(src)
    assert_same(evaluated, ran)
    note = decode_note(evaluated.report)
    # steps at 13-28 evaluated, 29 checks, 30-37 evaluated, 38 (= W - 2) checks, then views
    assert "24 of its 47 decode steps were evaluated" in note, note
    assert "(at cache lengths 29, 38)" in note
    assert note.endswith("then steps ran op by op (the cache keeps views of larger tensors "
                         "(a sliding window))")


def test_a_snapshot_names_the_evaluated_steps_buffers():
    from memmagic.core.snapshot import allocator_history

    out = simulate(cell("gpt2", tokens=12))
    trace = out.report.trace
    history = allocator_history(trace, trace.allocator_log.entries)
    names = {f["name"] for e in history for f in e["frames"]}
    assert "decode step at cache length 13, evaluated, not run: buffer 0" in names
    assert not any("cache length 12," in n for n in names)  # 10-12 ran: their ops' frames


def test_evaluated_buffers_leave_nothing_the_garbage_collector_tracks():
    """An evaluated step's buffers are keyed by plain ints, so the allocator log's entries
    for them (three a buffer, millions over 512 steps) stay out of the collector's passes."""
    out = simulate(cell("gpt2", tokens=24))
    entries = [e for e in out.report.trace.allocator_log.entries if key_frames(e.get("key"))]
    assert len(entries) > 100
    assert not any(gc.is_tracked(e) or gc.is_tracked(e["key"]) for e in entries)


def test_a_few_tokens_run_every_step():
    evaluated, ran = both(cell("gpt2", tokens=5))
    assert_same(evaluated, ran)
    assert decode_note(evaluated.report) is None


def test_a_stopping_criterion_that_reads_the_tokens_runs_every_step():
    src = MODELS["gpt2"] + """\
from transformers import StoppingCriteria, StoppingCriteriaList

class SeenToken(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -1] == 7)

""" + GENERATE.format(batch=1, tokens=12, sample=False,
                      extra=", stopping_criteria=StoppingCriteriaList([SeenToken()])")
    evaluated, ran = both(src)
    assert_same(evaluated, ran)
    assert decode_note(evaluated.report) == ("generate() ran every decode step op by op (a "
                                             "stopping criterion reads the tokens (SeenToken))")


BEAMS_OUT = """
calls = []
model.register_forward_pre_hook(lambda module, args: calls.append(1))
out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                     min_new_tokens=12, num_beams=3, num_return_sequences=2, pad_token_id=0,
                     return_dict_in_generate=True, output_scores=True)
assert len(calls) == 12, len(calls)
assert tuple(out.sequences.shape) == (4, 22), out.sequences.shape
assert tuple(out.beam_indices.shape) == (4, 12), out.beam_indices.shape
"""


@pytest.mark.parametrize("returns", ["tokens", "dict"])
def test_beam_search_runs_every_step_to_the_maximum_length_and_says_so(returns):
    """Beam search asks whether a beam is still open from the beams' scores (values a
    simulation has not): the placeholder ended it after one step and its crop, read off
    the beams' indices, left sequences of no tokens ((2, 0) where a GPU gives (2, 22)).
    As for sampling, no beam ends before the maximum length (min_new_tokens makes it so on
    a GPU too): every step runs and the sequences are whole, as the same code run for real
    on the CPU gives them."""
    if returns == "tokens":
        src = cell("gpt2", tokens=12, extra=", num_beams=2") + (
            "assert tuple(out.shape) == (2, 22), out.shape\n")
    else:
        src = MODELS["gpt2"] + "ids = torch.randint(0, 256, (2, 10), device='cuda')\n" + BEAMS_OUT
    evaluated, ran = both(src)
    assert evaluated.error is None, evaluated.error
    a, b = evaluated.report, ran.report
    assert log_of(a) == log_of(b) and (a.peak, a.reserved_peak) == (b.peak, b.reserved_peak)
    said = ("no beam was taken to end before the maximum length (a simulation reads no "
            "token, so no end-of-sequence), so every step ran and its sequences are "
            "max_length long)")
    assert decode_note(a) == ("generate() ran every decode step op by op (beam search: its "
                              "steps are not read off; " + said)
    assert decode_note(b) == "generate() ran every decode step op by op (beam search: " + said
    exec(textwrap.dedent(src).replace("cuda", "cpu"), {})  # the same, for real


def test_the_sampler_and_the_model_are_put_back():
    from transformers.generation.utils import GenerationMixin

    names = ("_sample", "_beam_search", "_assisted_decoding")
    originals = {name: GenerationMixin.__dict__[name] for name in names}
    session, ns = SimSession(), {}
    for src in (cell("gpt2", tokens=12), "own = sorted(vars(model))\n"):
        out = simulate(src, ns=ns, session=session)
        assert out.error is None, out.error
    assert {name: GenerationMixin.__dict__[name] for name in names} == originals
    assert "__call__" not in ns["own"] and "forward" not in ns["own"]


def test_an_interrupt_in_an_evaluated_step_frees_its_buffers(monkeypatch):
    """Ctrl-C while a step is evaluated: its transient buffers go back to the allocator's
    cache, as a GPU's frames free theirs; nothing stays allocated under their keys."""
    calls = []

    def empty(*args, **kwargs):
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return decode.torch.ops.aten.empty.memory_format(*args, **kwargs)

    monkeypatch.setattr(decode, "_EMPTY", empty)
    session = SimSession()
    out = simulate(cell("llama", tokens=16), session=session)
    assert isinstance(out.error, KeyboardInterrupt)
    allocator = session.card.tracker.allocator
    assert not [k for k in allocator._live if key_frames(k) is not None]
    live = session.card.tracker.live_device_bytes()
    assert allocator.allocated >= live  # what is held is the storages' (their blocks round up)


def test_the_magic_takes_decode_steps(ip):
    """``%%gpumem --decode-steps run`` runs every step; the default reads them off."""
    src = cell("gpt2", tokens=12)
    notes = {}
    for flag in ("", " --decode-steps run"):
        report = ip.run_cell_magic("gpumem", f"--backend sim --gpu T4 -o -q --no-chart{flag}", src)
        notes[flag] = decode_note(report)
    assert "7 of its 11 decode steps were evaluated" in notes[""]
    assert notes[" --decode-steps run"] is None


def test_decode_takes_evaluate_or_run():
    with pytest.raises(ValueError, match="decode takes one of"):
        SimBackend(decode="skip")


def test_a_line_is_drawn_only_through_steps_that_agree():
    step = decode._Step(10, (("a", 0), ("f", 0)), [512], {}, {}, {}, dict, {})

    def at(length, size):
        return decode._Step(length, step.codes, [size], {}, {}, {}, dict, {})

    assert decode._at(decode._Line([at(10, 1024), at(11, 1536), at(12, 2048)]).sizes, 20) == [6144]
    for sizes, why in (((1024, 1536, 2560), "not on the line"), ((2048, 1536, 1024), "shrinks")):
        with pytest.raises(decode._Unsupported, match=why):
            decode._Line([at(10 + i, n) for i, n in enumerate(sizes)])
    other = decode._Step(12, (("a", 0), ("a", 1), ("f", 0), ("f", 1)), [2048, 512], {}, {}, {},
                         dict, {})
    with pytest.raises(decode._Unsupported, match="did different things"):
        decode._Line([at(10, 1024), at(11, 1536), other])


def test_generate_under_inference_mode_stops_at_its_length_and_is_read_off():
    src = cell("gpt2", tokens=24).replace("out = model.generate(", "with torch.inference_mode():\n    out = model.generate(")
    evaluated, ran = both(src)
    assert evaluated.error is None and ran.error is None, (evaluated.error, ran.error)
    assert_same(evaluated, ran)
    assert "18 of its 23 decode steps were evaluated" in decode_note(evaluated.report)
