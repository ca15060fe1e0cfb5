"""The knob options a script takes on its own command line, given or found in its first run
(:mod:`memmagic.frontends.scriptflags`); the doctor's use of them: tests/frontends/test_cli.py."""

from __future__ import annotations

import argparse
import copy
import pickle
import sys
import threading

import pytest

from memmagic.core.patching import Patches
from memmagic.frontends.scriptflags import FlagWatch, flag_value, given_flags, with_flag_value
from memmagic.whatif.literals import Numbers, with_assignments


def test_a_flag_is_set_where_given_and_added_where_not():
    assert given_flags(["--batch-size", "16", "--lr", "3"]) == {"batch_size": "--batch-size"}
    assert given_flags(["--batch_size=big"]) == {}
    assert flag_value(["a", "--seq_len=128"], "--seq_len") == "128"
    assert with_flag_value(["--batch_size", "8", "x"], "--batch_size", "4") == \
        ["--batch_size", "4", "x"]
    assert with_flag_value(["10", "5"], "--batch_size", "4") == ["10", "5", "--batch_size=4"]


def test_the_watch_sees_argparse_and_a_loop_over_the_arguments_and_puts_both_back():
    ns: dict = {"lock": threading.Lock()}  # (a global that cannot be pickled)
    watch, patches = FlagWatch(ns), Patches()
    argv, parse = list(sys.argv), argparse.ArgumentParser.parse_known_args
    watch.install(patches, ["train.py", "7"])
    try:
        p = argparse.ArgumentParser()
        p.add_argument("epochs", type=int)
        p.add_argument("--per_device_train_batch_size", type=int, default=32)
        p.parse_args()
        assert not watch.argv_read  # argparse read them, not code with the script's globals
        exec("import sys\nfor a in sys.argv[1:]: pass", {})  # code of other globals
        assert not watch.argv_read
        exec("import sys\nbatch_size = 64\nfor a in sys.argv[1:]: pass", ns)
        # multiprocessing's spawn pickles sys.argv for its children: a plain list
        assert type(pickle.loads(pickle.dumps(sys.argv))) is list
        assert type(copy.copy(sys.argv)) is list
    finally:
        patches.restore()
    assert sys.argv == argv and argparse.ArgumentParser.parse_known_args is parse
    assert watch.argv_read
    assert watch.found({}) == {"batch_size": ("--per_device_train_batch_size", 32)}
    del watch.parsed["batch_size"]
    assert watch.found({}) == {"batch_size": ("--batch_size", 64)}
    assert watch.found({"batch_size": "--batch_size"}) == {}
    assert watch.honoured("batch_size", "--batch_size", 64)
    assert not watch.honoured("batch_size", "--batch_size", 16)


def test_an_option_given_under_another_name_or_a_configs_dotted_key_is_the_knobs():
    assert given_flags(["--trainer.batch_size=512", "--lr", "3"]) == \
        {"batch_size": "--trainer.batch_size"}
    assert given_flags(["data.batch_size=64", "model.block_size=128"]) == \
        {"batch_size": "data.batch_size", "seq_len": "model.block_size"}  # Hydra's overrides
    assert given_flags(["--trainer.batch_size=64", "--trainer.micro_batch_size=8"]) == \
        {"batch_size": "--trainer.micro_batch_size"}  # the batch one device takes
    # another name is the knob's where the script's argparse defines it (found in its run)
    assert given_flags(["--batch_size", "64", "--device-batch-size", "8"]) == \
        {"batch_size": "--batch_size"}
    assert given_flags(["a.batch_size", "7", "batch_size=8", "--bs=x", "--batch"]) == {}
    assert with_flag_value(["--trainer.batch_size=512"], "--trainer.batch_size", "128") == \
        ["--trainer.batch_size=128"]
    assert with_flag_value(["data.batch_size=64"], "data.batch_size", "8") == ["data.batch_size=8"]


@pytest.mark.parametrize("options, found", [
    # the names public scripts give the batch and the context, by their dest
    ((("--batch", 16), ("--max-seq-len", 2048)),
     {"batch_size": ("--batch", 16), "seq_len": ("--max-seq-len", 2048)}),
    ((("--bs", 8), ("--block_size", 256)),
     {"batch_size": ("--bs", 8), "seq_len": ("--block_size", 256)}),
    ((("--sequence_length", 1024),), {"seq_len": ("--sequence_length", 1024)}),
    # of a global and a per-device batch, the batch one device takes in a step
    ((("--total-batch-size", 524288), ("--batch_size", 64), ("--device-batch-size", 32)),
     {"batch_size": ("--device-batch-size", 32)}),
    ((("--micro_batch_size", 4), ("--batch_size", 128)), {"batch_size": ("--micro_batch_size", 4)}),
    ((("--max_tokens", 512), ("--max_length", 64)), {}),  # neither names a size it trains on
])
def test_a_scripts_options_for_the_batch_and_context_are_found_by_their_names(options, found):
    watch, patches = FlagWatch({}), Patches()
    watch.install(patches, ["train.py"])
    try:
        p = argparse.ArgumentParser()
        for flag, default in options:
            p.add_argument(flag, type=int, default=default)
        p.parse_args()
    finally:
        patches.restore()
    assert watch.found({}) == found


def test_a_configurators_global_of_a_knobs_other_name_is_its_option():
    """nanoGPT's configurator sets any global from ``--name=N``: its ``block_size`` is the
    context, taken as ``--block_size``, and checked by that global in each later run."""
    ns: dict = {}
    watch, patches = FlagWatch(ns), Patches()
    watch.install(patches, ["train.py"])
    try:
        exec("import sys\nbatch_size, block_size, eval_iters = 12, 1024, 200\n"
             "for arg in sys.argv[1:]: pass", ns)
    finally:
        patches.restore()
    assert watch.found({}) == {"batch_size": ("--batch_size", 12),
                               "seq_len": ("--block_size", 1024)}
    assert watch.honoured("seq_len", "--block_size", 1024)
    assert not watch.honoured("seq_len", "--block_size", 512)


def test_a_number_set_once_at_the_top_level_is_found_and_set_where_it_stands():
    source = ("import torch\n"
              "batch_size = 64  # sequences a step\n"
              "if torch is not None:\n"
              "    seq_len: int = 256\n"
              "def f():\n"
              "    batch_size = 3\n"
              "    return batch_size\n"
              "line = __import__('sys')._getframe().f_lineno\n")
    assert Numbers(source, compile).at == {"batch_size": (2, 64), "seq_len": (4, 256)}
    for not_one in ("batch_size = 4\nbatch_size = 8\n", "batch_size = 4\nbatch_size += 1\n",
                    "batch_size = 2 * 32\n", "batch_size = True\n", "batch_size = 6.0\n",
                    "for batch_size in (1, 2): pass\nbatch_size = 4\n",
                    "batch_size, n = sizes\n", "batch_size, *n = 4, 5, 6\n",
                    "batch_size, n = 4, 5\nbatch_size = 2\n", "lr = 64\n"):
        assert "batch_size" not in Numbers(not_one, compile).at, not_one
    # names set from a tuple of numbers written out, each at its place
    pair = "batch_size, seq_len = 4, 1024  # a step\n[x, accum_steps] = [1, 8]\n"
    assert Numbers(pair, compile).at == {"batch_size": (1, 4), "seq_len": (1, 1024),
                                         "accum_steps": (2, 8)}
    assert with_assignments(pair, {"seq_len": 64, "accum_steps": 2}) == (
        "batch_size, seq_len = 4, 64  # a step\n[x, accum_steps] = [1, 2]\n")
    ns: dict = {}
    numbers = Numbers(source, lambda text: compile(text, "train.py", "exec"))
    exec(numbers.compiled({"batch_size": 16, "seq_len": 32}), ns)
    assert (ns["batch_size"], ns["seq_len"], ns["f"](), ns["line"]) == (16, 32, 3, 8)
    assert ns["f"].__code__.co_filename == "train.py"
    assert numbers.compiled({"batch_size": 64, "seq_len": 256}) is None  # as written


def test_a_settings_dicts_entry_is_a_number_set_where_it_stands():
    """``{"batch_size": 8}`` or ``dict(batch_size=8)``, once at the top level, with no
    variable of that name: the entry is where the size is set; two such entries, a
    variable of that name, or a value that is not a whole number written out are not."""
    source = ('if __name__ == "__main__":\n'
              '    CFG = {"lr": 5e-4, "batch_size": 8}\n'
              '    OPT = dict(accum_steps=4)\n')
    numbers = Numbers(source, compile)
    assert numbers.at == {"batch_size": (2, 8), "accum_steps": (3, 4)}
    assert set(numbers.keyed) == {"batch_size", "accum_steps"}
    assert numbers.written("batch_size") == '"batch_size": 8'
    assert numbers.written("accum_steps") == "accum_steps=4"
    assert with_assignments(source, {"batch_size": 2}) == source.replace('": 8', '": 2')
    for not_one in ('a = {"batch_size": 8}\nb = {"batch_size": 4}\n',
                    'a = {"batch_size": 8 * 2}\n', 'a = {"batch_size": n}\n',
                    'def f():\n    return {"batch_size": 8}\n'):
        assert "batch_size" not in Numbers(not_one, compile).at, not_one
    both = Numbers('batch_size = 4\ncfg = {"batch_size": 8}\n', compile)
    assert both.at == {"batch_size": (1, 4)} and not both.keyed


def test_a_calls_argument_under_the_name_is_a_number_set_where_it_stands():
    """``DataLoader(ds, batch_size=1024)`` (a keyword of any call, or the knob's other script
    name: ``per_device_train_batch_size=16``) and ``train(64)`` (the source's own ``def
    train(batch_size)``), with no variable of that name: the argument is where the size is
    set. Two loaders of one batch size are both set; two of different
    sizes, a function defined twice or also imported, a starred argument before it, or one
    inside a function are not; a variable of that name is the one set."""
    loaders = ("from torch.utils.data import DataLoader\n"
               "train = DataLoader(ds, batch_size=1024, shuffle=True)\n"
               "val = DataLoader(vs, batch_size=1024)\n")
    numbers = Numbers(loaders, compile)
    assert numbers.at == {"batch_size": (2, 1024)}
    assert numbers.written("batch_size") == "batch_size=1024"
    assert with_assignments(loaders, {"batch_size": 96}) == loaders.replace("=1024", "=96")
    call = ("def step(batch_size, seq_len=128):\n"
            "    return batch_size * seq_len\n"
            "out = step(512, 64)\n")
    numbers = Numbers(call, lambda text: compile(text, "cell", "exec"))
    assert numbers.at == {"batch_size": (3, 512), "seq_len": (3, 64)}
    assert numbers.written("batch_size") == "step(512)"
    ns: dict = {}
    exec(numbers.compiled({"batch_size": 8, "seq_len": 64}), ns)
    assert ns["out"] == 8 * 64 and numbers.compiled({"batch_size": 512, "seq_len": 64}) is None
    for not_one in ("a = DataLoader(ds, batch_size=64)\nb = DataLoader(vs, batch_size=256)\n",
                    "DataLoader(ds, batch_size=n)\n",
                    "def step(batch_size): pass\ndef step(batch_size): pass\nstep(64)\n",
                    "from x import step\ndef step(batch_size): pass\nstep(64)\n",
                    "def step(a, batch_size): pass\nstep(*xs, 64)\n",
                    "def f():\n    DataLoader(ds, batch_size=64)\n"):
        assert "batch_size" not in Numbers(not_one, compile).at, not_one
    both = Numbers("batch_size = 8\nDataLoader(ds, batch_size=64)\n", compile)
    assert both.at == {"batch_size": (1, 8)} and not both.keyed  # the variable's
    # transformers' TrainingArguments names the batch per_device_train_batch_size (the
    # batch knob's other script name), with a loader of the same size or alone
    trainer = ("args = TrainingArguments(output_dir='out', per_device_train_batch_size=16,\n"
               "                         fp16=True)\n"
               "loader = DataLoader(ds, batch_size=16)\n")
    numbers = Numbers(trainer, lambda text: text)  # "compiled": the text it would run
    assert numbers.at == {"batch_size": (1, 16)}
    assert numbers.written("batch_size") == "per_device_train_batch_size=16"
    assert numbers.compiled({"batch_size": 4}) == trainer.replace("=16", "=4")
    assert "batch_size" not in Numbers(trainer.replace("batch_size=16)", "batch_size=8)"),
                                       compile).at

