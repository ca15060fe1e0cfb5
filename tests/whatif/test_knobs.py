"""Knobs as data (each knob one entry of KNOBS, found elsewhere by what its entry says,
never by its name) and settings. The Applier: tests/whatif/test_apply.py."""

from __future__ import annotations

import ast
import pathlib

import pytest

import memmagic
from memmagic.whatif.knobs import (BATCH_DIM, KNOBS, SEQ_DIM, Fixes, KnobError, Setting,
                                   accumulating, for_backend_option, panel_sweep, resizing,
                                   targeting)


def test_a_setting_keeps_only_what_differs_from_the_cell_as_written():
    s = Setting(amp="off", checkpointing=False, batch_size=32)
    assert s.changed() == {"batch_size": 32}
    assert s.amp == "off" and s.accum_steps == 1 and s.optimizer is None
    assert s == Setting(batch_size=32) and hash(s) == hash(Setting(batch_size=32))
    assert Setting().label() == "as written"


def test_setting_values_are_normalised_and_checked():
    s = Setting(checkpointing="on", batch_size="64", amp="FP16", gpu="t4")
    assert (s.checkpointing, s.batch_size, s.amp, s.gpu) == (True, 64, "fp16", "T4")
    with pytest.raises(KnobError, match="off, fp16, bf16"):
        Setting(amp="fp8")
    with pytest.raises(KnobError, match="whole number"):
        Setting(batch_size=2.5)
    with pytest.raises(KnobError, match="between 1 and"):
        Setting(accum_steps=0)
    with pytest.raises(KnobError, match="T4"):
        Setting(gpu="H900")
    with pytest.raises(TypeError, match="unknown knob 'ampp'"):
        Setting(ampp="fp16")
    with pytest.raises(AttributeError, match="immutable"):
        s.amp = "bf16"


def test_label_says_effective_and_micro_batch():
    s = Setting(batch_size=64, accum_steps=4, amp="bf16", checkpointing=True)
    assert s.micro_batch == 16
    assert s.label() == "batch 64 (4 x 16), amp bf16, ckpt"
    with pytest.raises(KnobError, match="multiple of 4"):
        Setting(batch_size=30, accum_steps=4).check_batch()


def test_every_knob_says_how_it_is_applied_and_what_it_needs():
    for k in KNOBS.values():
        assert k.how and k.needs in {"model", "float_weights", "batch", "seq", "generate",
                                      "accum", "blocks", "backward", "optimizer", "inplace", "sim"}
        assert Setting(**{k.name: k.default}) == Setting()


# -- each knob one entry: found by what its entry says, never by its name ----------------------
ROOT = pathlib.Path(memmagic.__file__).parent
THE_TABLE = {"whatif/knobs.py", "whatif/apply.py"}  # where a knob's name is its entry's
# (file, word): why the word is there though it is not the knob
NOT_THE_KNOB = {
    ("trace.py", "optimizer"): "the optimizer phase of a timeline (PHASES)",
    ("report.py", "optimizer"): "the optimizer phase of a timeline",
    ("core/tracking.py", "optimizer"): "the phase recorded while an optimizer step runs",
    ("backends/sim/tracker.py", "optimizer"): "the optimizer phase, in words",
    ("charts/plots.py", "optimizer"): "the optimizer phase's colour and short name",
    ("charts/plots.py", "batch_size"): "plot_sweep's default axis label: the charts know no "
                                       "knobs (Sweep.figure passes its knob)",
    ("pipeline.py", "gpu"): "the simulated backend's gpu= option",
    ("doctor/ranking.py", "gpu"): "the simulated backend's gpu= option: the FSDP2 rows' card",
    ("whatif/engine.py", "gpu"): "Cell(gpu=...), the simulated backend's gpu= option",
    ("report.py", "gpu_name"): "the report's field for the card's name",
    ("whatif/sweeps.py", "gpu_name"): "the report field an interpolated point shares with its runs",
}


def _named_knobs() -> dict[tuple[str, str], list[int]]:
    """(file, word) -> lines of the string literals in memmagic's code outside the knob
    table that are a knob's name or its variable's."""
    words = set(KNOBS) | {k.var for k in KNOBS.values()}
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in THE_TABLE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in words:
                found.setdefault((rel, node.value), []).append(node.lineno)
    return found


def test_no_code_names_a_knob_outside_the_table():
    found = _named_knobs()
    named = {f"{rel}:{lines[0]}: {word!r}" for (rel, word), lines in found.items()
             if (rel, word) not in NOT_THE_KNOB}
    assert named == set(), "find the knob by its entry (knobs.resizing, accumulating, ...)"
    assert set(NOT_THE_KNOB) <= set(found), "an allowance no longer needed: remove it"


def test_code_finds_the_knobs_by_what_their_entries_say():
    assert resizing(BATCH_DIM) is KNOBS["batch_size"] and resizing(SEQ_DIM) is KNOBS["seq_len"]
    assert accumulating() is KNOBS["accum_steps"] and panel_sweep() is KNOBS["batch_size"]
    assert for_backend_option("gpu") is KNOBS["gpu"] and for_backend_option("device") is None
    assert targeting() is KNOBS["gpu"]
    with pytest.raises(LookupError, match="no knob of memmagic.KNOBS resizes dimension 2"):
        resizing(2)
    assert [k.name for k in KNOBS.values() if k.sizes is not None] == \
        ["batch_size", "seq_len", "accum_steps"]
    assert KNOBS["gpu"].backend.replaces == ("gpu_memory",) and KNOBS["gpu"].apply is None
    assert "T4" in KNOBS["gpu"].values() and KNOBS["gpu"].panel.unset_label == "no card"


def test_a_script_takes_the_knobs_that_size_its_data_on_its_command_line():
    assert KNOBS["batch_size"].script_flags == ("--batch_size", "--batch-size")
    assert KNOBS["seq_len"].script_flags == ("--seq_len", "--seq-len")
    assert KNOBS["accum_steps"].script_flags == ("--accum_steps", "--accum-steps")
    assert [k.name for k in KNOBS.values() if k.script_flags] == \
        ["batch_size", "seq_len", "accum_steps"]
    # argparse destinations that carry the value, the batch one device takes in a step
    # first (a transformers Trainer's per-device batch before a global one)
    dests = KNOBS["batch_size"].script_dests
    assert dests[0] == "per_device_train_batch_size" and "bs" in dests
    assert dests.index("micro_batch_size") < dests.index("batch_size") < dests.index("batch")
    assert KNOBS["seq_len"].script_dests == ("seq_len",) and KNOBS["amp"].script_dests == ()
    # options only: as a call's keyword, block_size sizes a model (GPTConfig(block_size=...))
    assert KNOBS["seq_len"].option_dests[0] == "seq_len"
    assert {"block_size", "max_seq_len", "sequence_length"} <= set(KNOBS["seq_len"].option_dests)
    assert KNOBS["amp"].option_dests == ()


def test_the_doctors_families_and_exclusions_are_in_the_entries():
    assert KNOBS["batch_size"].family == KNOBS["accum_steps"].family == "batch"
    assert KNOBS["seq_len"].family == "seq_len" and KNOBS["amp"].family == "amp"
    assert KNOBS["amp"].doctor.excluded_by == ("weights_dtype",)
    assert KNOBS["batch_size"].doctor.untried["cell"].startswith("no smaller batch was tried")
    assert "--batch_size N" in KNOBS["batch_size"].doctor.untried["script"]
    assert [k.name for k in KNOBS.values() if k.doctor.untried] == ["batch_size"]
    assert [f for f, _ in KNOBS["batch_size"].doctor.fixes(Fixes(batch=64))] == \
        ["batch 32 (from 64)", "batch 16 (from 64)"]


def test_the_option_and_the_control_are_in_the_entries():
    flags, kwargs = KNOBS["checkpointing"].argument()
    assert flags == ("--checkpointing",) and kwargs["metavar"] == "MODULE"
    assert kwargs["nargs"] == "?" and kwargs["const"] == "on"
    assert KNOBS["checkpointing"].from_option("Block") == (True, {"checkpoint_module": "Block"})
    for word, on in [("on", True), ("yes", True), ("1", True), ("off", False), ("false", False),
                     ("no", False), ("0", False)]:
        assert KNOBS["checkpointing"].from_option(word) == (on, {})
    assert KNOBS["gpu"].option is None and KNOBS["gpu"].argument()[0] == ("--gpu",)
    assert KNOBS["batch_size"].span(1024) == (1, 4096) and KNOBS["accum_steps"].span(2) == (1, 16)
    assert KNOBS["grad_mode"].panel.widget == "buttons" and KNOBS["seq_len"].panel.grow
