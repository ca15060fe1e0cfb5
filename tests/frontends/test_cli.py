"""The command line: ``python -m memmagic run train.py`` on a nanoGPT-like script (its
argparse, its loop cut after N optimizer steps, forward passes or seconds), and the one
line it answers bad input with, before the run. The scratch disk the script runs over:
tests/frontends/test_cli_disk.py."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import textwrap

import pytest

from memmagic.frontends import cli

TRAIN = textwrap.dedent('''
    import argparse
    import torch
    from memmagic import zoo

    p = argparse.ArgumentParser()
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--iters", type=int, default=1000)
    args = p.parse_args()
    model, _ = zoo.build("nanogpt", device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for it in range(args.iters):
        xb = torch.randint(0, 1000, (args.batch_size, 128), device="cuda")
        loss = model.loss(xb, xb)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    print("trained", it + 1, "steps")
''')


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return path


def test_a_script_runs_on_the_simulated_gpu_cut_after_its_steps(script, tmp_path, capsys, clean_state):
    argv, path = list(sys.argv), list(sys.path)
    out = tmp_path / "r.json"
    rc = cli.main(["run", "--gpu", "T4", "--steps", "2", "--json", str(out), "--timeline",
                   str(tmp_path / "t.png"), "--snapshot", str(tmp_path / "s.pickle"),
                   str(script), "--batch_size", "16"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert sys.argv == argv and sys.path == path  # put back
    assert "trained" not in text  # the loop of 1000 iterations was cut
    assert "note: stopped after 2 optimizer step(s) (--steps 2)" in text
    assert "target GPU       T4 14.74 GiB: fits" in text and "peak reached     during loss.backward()" in text
    report = json.loads(out.read_text())
    assert report["backend"] == "sim" and report["gpu_name"] == "T4"
    assert "stopped after 2 optimizer step(s) (--steps 2)" in report["notes"]  # the run's too
    assert report["breakdown"]["optimizer_state"] > 0  # AdamW's state: a step ran
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    assert "segments" in pickle.loads((tmp_path / "s.pickle").read_bytes())
    # the script's own arguments reach its argparse: a larger batch needs more
    cli.main(["run", "--gpu", "T4", "--steps", "1", "--json", str(out), str(script), "--batch_size", "64"])
    assert json.loads(out.read_text())["peak"] > report["peak"]
    capsys.readouterr()


def test_python_dash_m_memmagic_and_its_failures(script, tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "memmagic", "run", *args], capture_output=True,
                              text=True, cwd=tmp_path)
    oom = run("--gpu", "T4", "--steps", "1", str(script), "--batch_size", "8192")
    assert oom.returncode == 1 and "memmagic: out of memory on simulated cuda:0 (T4)" in oom.stderr
    assert "does not fit" in oom.stdout  # the doctor's ranked fixes
    (tmp_path / "reads.py").write_text("import numpy as np\n"
                                       "data = np.memmap('data/train.bin', dtype=np.uint16, mode='r')\n")
    data = run("--gpu", "T4", "reads.py")
    assert data.returncode == 1
    assert "the script reads data/train.bin, which is not here" in data.stderr
    missing = run("nothere.py")
    assert missing.returncode == 2 and missing.stderr.startswith("memmagic: no script at nothere.py")
    steps = run("--steps", "0", str(script))
    assert steps.returncode == 2 and "--steps needs a positive number" in steps.stderr


def test_a_failed_script_shows_where_as_python_does(tmp_path, capsys, clean_state):
    """A script that fails (not out of memory) prints its traceback, the script's frames
    and the libraries' but not memmagic's, then the one line; no word of %debug, which a
    script's process does not keep."""
    (tmp_path / "fails.py").write_text(textwrap.dedent('''
        import torch

        def build(n):
            return torch.nn.Linear(n, n).cuda()

        model = build(64)
        model(torch.randn(4, 32, device="cuda"))
    '''))
    rc = cli.main(["run", "--gpu", "T4", str(tmp_path / "fails.py")])
    captured = capsys.readouterr()
    assert rc == 1
    err = captured.err
    assert err.index("Traceback (most recent call last)") < err.index("memmagic: the script failed")
    assert re.search(r'fails.py", line 8, in <module>\n +model\(torch.randn', err)
    assert "torch/nn/modules/linear.py" in err and "/memmagic/" not in err
    assert "%debug" not in captured.out + err
    # a call the simulation cannot make: its one line, without how memmagic found it
    (tmp_path / "mps.py").write_text("import torch\ntorch.nn.Linear(2, 2).to('mps')\n")
    assert cli.main(["run", "--gpu", "T4", str(tmp_path / "mps.py")]) == 1
    err = capsys.readouterr().err
    assert 'mps.py", line 2, in <module>' in err and "device 'mps' is not simulated" in err
    assert "/memmagic/" not in err and "direct cause" not in err and "During handling" not in err
    # an error with no message (a bare assert): its one line says where, as the report does
    (tmp_path / "asserts.py").write_text("import torch\nbatch = 24\nassert 128 % batch == 0\n")
    assert cli.main(["run", "--gpu", "T4", str(tmp_path / "asserts.py")]) == 1
    captured = capsys.readouterr()
    assert ("memmagic: the script failed: AssertionError at line 3 (`assert 128 % batch == 0`)"
            in captured.err)
    assert "script failed: AssertionError at line 3 (`assert 128 % batch == 0`)" in captured.out


def test_an_out_of_memory_the_script_exits_on_is_reported_as_one(tmp_path, capsys, clean_state):
    """hydra's main (pytorch/examples' minGPT-ddp) catches a job's error, prints it and calls
    sys.exit(1): an out of memory it exits on is the run's out of memory, with the doctor's
    fixes, as if it had gone up; an exit on another error stays that exit."""
    (tmp_path / "exits.py").write_text(textwrap.dedent('''
        import sys
        import torch

        batch_size = 64

        def job():
            x = torch.randn(batch_size, 1 << 22, device="cuda", requires_grad=True)
            (x * 2).sum().backward()

        try:
            job()
        except Exception as e:
            print(f"Error executing job: {type(e).__name__}", file=sys.stderr)
            sys.exit(1)
    '''))
    rc = cli.main(["run", "--gpu-memory", "600MiB", str(tmp_path / "exits.py")])
    captured = capsys.readouterr()
    assert rc == 1 and "Error executing job: SimulatedOutOfMemoryError" in captured.err
    assert "out of memory    a request of 1.00 GiB failed" in captured.out
    assert ("note: the script caught the out of memory and exited (sys.exit(1), as hydra's "
            "main does after it prints the error): the report is the out of memory's"
            in captured.out)
    assert re.search(r"batch \d+ \(from 64\).*fits", captured.out), captured.out
    assert "SystemExit" not in captured.out + captured.err
    # an exit on an error that is not an out of memory stays the script's exit
    (tmp_path / "other.py").write_text("import sys\ntry:\n    1 / 0\nexcept Exception:\n"
                                       "    sys.exit(3)\n")
    assert cli.main(["run", "--gpu", "T4", str(tmp_path / "other.py")]) == 1
    captured = capsys.readouterr()
    assert "the script failed: SystemExit: 3" in captured.err
    assert "caught the out of memory" not in captured.out


TRAINER = textwrap.dedent('''
    import argparse
    import torch
    from torch.utils.data import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    p = argparse.ArgumentParser()
    p.add_argument("--batch_size", type=int, default=4)
    a = p.parse_args()


    class RandomTokens(Dataset):
        def __len__(self):
            return 1000

        def __getitem__(self, i):
            ids = torch.randint(0, 8000, (128,))
            return {"input_ids": ids, "labels": ids}


    model = LlamaForCausalLM(LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1376,
                                         num_hidden_layers=2, num_attention_heads=8,
                                         num_key_value_heads=8))
    args = TrainingArguments(output_dir="hf_out", per_device_train_batch_size=a.batch_size,
                             max_steps=1000, report_to=[], save_strategy="no",
                             logging_steps=10**6)
    Trainer(model=model, args=args, train_dataset=RandomTokens()).train()
    print("trained")
''')


def test_a_transformers_trainer_script_built_from_a_config(tmp_path, monkeypatch, capsys, clean_state):
    pytest.importorskip("transformers")
    (tmp_path / "train_hf.py").write_text(TRAINER)
    monkeypatch.chdir(tmp_path)  # Trainer makes its output_dir where the script runs
    out = tmp_path / "r.json"
    rc = cli.main(["run", "--gpu", "T4", "--steps", "2", "--json", str(out), "train_hf.py",
                   "--batch_size", "8"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "trained" not in text and "note: stopped after 2 optimizer step(s) (--steps 2)" in text
    report = json.loads(out.read_text())
    # fp32: embeddings and lm_head 8000 x 512, per layer q k v o 512 x 512, gate up down
    # 1376 x 512 and two RMSNorms, the final RMSNorm: 58,075,136 B in 21 tensors
    params = 2 * 8000 * 512 * 4 + 2 * (4 * 512 * 512 + 3 * 1376 * 512 + 2 * 512) * 4 + 512 * 4
    assert report["breakdown"]["parameters"] == params
    # Trainer's default optimizer is torch's fused AdamW: two moments per parameter and a
    # step counter per tensor on the GPU (one 512-byte block each)
    assert report["breakdown"]["optimizer_state"] == 2 * params + 21 * 512
    assert report["breakdown"]["activations"] > 0 and "fits" in text
    # Trainer made its output_dir in the scratch directory, not here
    assert not (tmp_path / "hf_out").exists()
    assert "note: the script made hf_out" in text and "nothing on disk was changed" in text


def test_whatif_knobs_apply_to_the_script_and_bad_ones_get_one_line(script, capsys, clean_state):
    rc = cli.main(["run", "--gpu", "T4", "--steps", "1", "--json", "/dev/null", str(script)])
    base = capsys.readouterr().out
    assert rc == 0, base
    rc = cli.main(["run", "--gpu", "T4", "--steps", "1", "--whatif", "amp=bf16", str(script)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "note: what-if setting: amp bf16" in text and "what-if" not in base

    def peak_of(out: str) -> str:
        return next(line for line in out.splitlines() if line.startswith("  peak "))
    assert peak_of(text) != peak_of(base)
    for bad, says in ((["--whatif", "amp"], "takes KNOB=VALUE"),
                      (["--whatif", "speed=fast"], "unknown knob 'speed'"),
                      (["--whatif", "batch_size=big"], "takes a whole number")):
        assert cli.main(["run", *bad, str(script)]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1


def test_the_doctor_resizes_the_batch_the_script_takes_from_its_command_line(script, capsys,
                                                                            clean_state):
    """--batch_size on the script's command line is the batch knob: after an out of memory
    the doctor's re-runs give the script smaller values, each from a fresh __main__."""
    rc = cli.main(["run", "--gpu-memory", "256MiB", "--steps", "1", str(script), "--batch_size", "64"])
    out = capsys.readouterr()
    assert rc == 1 and "out of memory" in out.err
    rows = [line for line in out.out.splitlines() if "(from 64)" in line]
    assert rows and any(line.rstrip().endswith("fits") for line in rows), out.out
    rc = cli.main(["run", "--gpu-memory", "256MiB", "--steps", "1", "--whatif", "batch_size=16",
                   str(script), "--batch_size", "64"])
    text = capsys.readouterr().out
    assert rc == 0 and "note: what-if setting: batch 16" in text


def test_files_the_script_writes_go_to_a_scratch_directory(tmp_path, monkeypatch, capsys, clean_state):
    import builtins
    import os

    (tmp_path / "w.py").write_text(textwrap.dedent('''
        import os, pathlib, torch
        os.makedirs("ckpt/run1", exist_ok=True)
        with open("ckpt/run1/log.txt", "w") as f:
            f.write("step 1")
        pathlib.Path("ckpt/notes.txt").write_text("hello")
        assert os.path.isdir("ckpt/run1") and os.path.exists("ckpt/notes.txt")
        with open("ckpt/run1/log.txt") as f:
            print("read back:", f.read())
        m = torch.nn.Linear(8, 8).cuda()
        torch.save(m.state_dict(), "ckpt/m.pt")
    '''))
    monkeypatch.chdir(tmp_path)
    opened = builtins.open
    assert cli.main(["run", "--gpu", "T4", "w.py"]) == 0
    text = capsys.readouterr().out
    assert "read back: step 1" in text
    assert sorted(os.listdir(tmp_path)) == ["w.py"]  # nothing written here
    assert "note: the script wrote ckpt" in text
    assert builtins.open is opened and os.makedirs.__module__ == "os"  # put back


EVAL = textwrap.dedent('''
    import torch
    model = torch.nn.Linear(64, 64).cuda().eval()
    with torch.no_grad():
        for i in range(200):
            model(torch.randn(8, 64, device="cuda"))
    print("evaluated", i + 1)
''')


def test_steps_end_a_script_that_makes_no_optimizer_after_its_forward_passes(tmp_path, capsys,
                                                                            clean_state):
    (tmp_path / "ev.py").write_text(EVAL)
    rc = cli.main(["run", "--gpu", "T4", "--steps", "3", str(tmp_path / "ev.py")])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "evaluated" not in text
    assert "note: stopped after 3 forward passes (--steps 3: the script made no optimizer" in text


def test_steps_count_optimizer_steps_when_the_script_evaluates_first(tmp_path, capsys,
                                                                    clean_state):
    """A training script that evaluates before its first step (nanoGPT's estimate_loss)
    is cut at its optimizer steps, not at its evaluation's forward passes."""
    (tmp_path / "t.py").write_text(textwrap.dedent('''
        import torch
        model = torch.nn.Linear(64, 64).cuda()
        opt = torch.optim.AdamW(model.parameters())
        with torch.no_grad():
            for _ in range(5):
                model(torch.randn(8, 64, device="cuda"))
        for _ in range(10):
            model(torch.randn(8, 64, device="cuda")).sum().backward()
            opt.step()
    '''))
    rc = cli.main(["run", "--gpu", "T4", "--steps", "2", str(tmp_path / "t.py")])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "note: stopped after 2 optimizer step(s) (--steps 2)" in text
    assert "the script ran 5 forward passes" not in text  # 5: no note on their cost


def test_an_optimizer_that_steps_others_makes_one_step(tmp_path, capsys, clean_state):
    """A container of optimizers that is an optimizer itself (torchtitan's
    OptimizersContainer: one per model part) steps each inside its own step: one training
    step, not three, and the cut waits for the outer step to end."""
    (tmp_path / "t.py").write_text(textwrap.dedent('''
        import torch
        parts = [torch.nn.Linear(64, 64).cuda() for _ in range(2)]

        class Container(torch.optim.Optimizer):
            def __init__(self, parts):
                self.inner = [torch.optim.AdamW(p.parameters()) for p in parts]
                super().__init__([q for p in parts for q in p.parameters()], {})
            def step(self, closure=None):
                for o in self.inner:
                    o.step()

        opt = Container(parts)
        done = 0
        for _ in range(10):
            sum(p(torch.randn(8, 64, device="cuda")).sum() for p in parts).backward()
            opt.step()
            done += 1
            print("done", done, "steps; both parts stepped:",
                  all(len(o.state) == 2 for o in opt.inner))
    '''))
    rc = cli.main(["run", "--gpu", "T4", "--steps", "2", str(tmp_path / "t.py")])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "done 1 steps; both parts stepped: True" in text and "done 2" not in text
    assert "note: stopped after 2 optimizer step(s) (--steps 2)" in text


def test_a_long_evaluation_gets_a_note_on_what_it_costs(tmp_path, capsys, clean_state):
    """nanoGPT evaluates 400 batches before its first step: each is simulated, and every
    re-run of the doctor repeats them; the note says so (from cli.EVALUATION_NOTE_AT)."""
    n = cli.EVALUATION_NOTE_AT
    (tmp_path / "t.py").write_text(textwrap.dedent(f'''
        import torch
        model = torch.nn.Linear(64, 64).cuda()
        opt = torch.optim.AdamW(model.parameters())
        model.eval()
        with torch.no_grad():
            for _ in range({n}):
                model(torch.randn(8, 64, device="cuda"))
        model.train()
        model(torch.randn(8, 64, device="cuda")).sum().backward()
        opt.step()
    '''))
    rc = cli.main(["run", "--gpu", "T4", "--steps", "1", str(tmp_path / "t.py")])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert (f"note: the script ran {n} forward passes with gradients off (an evaluation): the "
            "simulation runs each one that does not repeat the calls before it exactly (the "
            "others are evaluated, as a note says), and each re-run of the doctor repeats "
            "them") in text
    evaluated = next(line for line in text.splitlines() if "were evaluated, not run" in line)
    # the first makes cuBLAS's workspace, two agree, one checks after 16 evaluated
    assert evaluated.split()[1] == str(n - 4), evaluated
    assert evaluated.endswith("1 call ran op by op as a check and did the same")


def test_a_time_limit_cuts_the_run_and_a_long_run_shows_progress(tmp_path, capsys, monkeypatch,
                                                                clean_state):
    from memmagic.frontends import scriptrun

    monkeypatch.setattr(scriptrun.ScriptRun, "progress_every_s", 0.3)
    (tmp_path / "slow.py").write_text(textwrap.dedent('''
        import time
        while True:  # no model, no optimizer: only the clock ends it
            time.sleep(0.05)
    '''))
    rc = cli.main(["run", "--gpu", "T4", "--time-limit", "1", str(tmp_path / "slow.py")])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "note: stopped at --time-limit 1 s, after" in out.out
    assert re.search(r"memmagic: slow.py running: \d+ s, 0 optimizer step\(s\), "
                     r"0 forward pass\(es\)", out.err)


def test_a_time_limit_past_the_simulations_own_bound_is_the_one_that_stops_it(
        tmp_path, capsys, monkeypatch, clean_state):
    from memmagic.backends.sim import SimBackend

    # the time limit cuts within a second of its time (at a step, a forward pass or a line
    # of the script): the simulation's bound, 2 s here, would have stopped it first
    monkeypatch.setattr(SimBackend, "DEFAULT_MAX_SECONDS", 2.0)
    (tmp_path / "ops.py").write_text(textwrap.dedent('''
        import torch
        model = torch.nn.Linear(8, 8).cuda()
        x = torch.ones(8, 8, device="cuda")
        while True:  # each forward pass ends where the time limit may cut
            x = model(x).detach()
    '''))
    rc = cli.main(["run", "--gpu", "T4", "--time-limit", "3", str(tmp_path / "ops.py")])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "note: stopped at --time-limit 3 s, after" in out.out
    assert "max_seconds" not in out.out + out.err


@pytest.mark.parametrize("options, says", [
    (["--json", "no/such/folder/r.json"],
     "--json no/such/folder/r.json: the folder no/such/folder does not exist"),
    (["--timeline", "."], "--timeline .: is a directory"),
    (["--snapshot", "nowhere/s.pickle"],
     "--snapshot nowhere/s.pickle: the folder nowhere does not exist"),
    (["--gpu", ""], "--gpu needs a card name, one of"),
    (["--gpu-memory", " "], "--gpu-memory needs a size with a unit"),
    (["--gpu-memory", "99999999999999TiB"], "--gpu-memory 99999999999999TiB is "),
    (["--time-limit", "0"], "--time-limit needs a positive number of seconds"),
    (["--whatif", "accum_steps=2"],
     "--whatif accum_steps needs a script that takes its accumulation steps on its command "
     "line (--accum_steps N"),
    (["--whatif", "seq_len=64"], "--whatif seq_len needs a script that takes its sequence"),
], ids=["json", "timeline", "snapshot", "gpu", "gpu-memory", "huge-card", "time-limit",
        "accum_steps", "seq_len"])
def test_bad_input_gets_one_line_before_the_run(tmp_path, monkeypatch, capsys, options, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.py").write_text("print('the script ran')\n")
    rc = cli.main(["run", "--gpu-memory", "1GiB", *options, "s.py", "--batch_size", "8"])
    out = capsys.readouterr()
    assert rc == 2
    assert out.err.startswith(f"memmagic: {says}") and len(out.err.strip().splitlines()) == 1
    assert "the script ran" not in out.out


@pytest.mark.parametrize("source, says", [
    (b"import torch\nx = (\n", "bad.py line 2: '(' was never closed: fix the script"),
    (b"print('caf\xe9')\n",
     "bad.py line 1: byte 0xe9 is not utf-8 text: save the script as UTF-8"),
], ids=["syntax", "encoding"])
def test_a_script_that_does_not_compile_gets_one_line(tmp_path, monkeypatch, capsys, source,
                                                      says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.py").write_bytes(source)
    rc = cli.main(["run", "--gpu", "T4", "bad.py"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"memmagic: {says}") and len(err.strip().splitlines()) == 1


def test_a_script_that_declares_its_encoding_runs(tmp_path, monkeypatch, capsys, clean_state):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "latin.py").write_bytes(b"# -*- coding: latin-1 -*-\nprint('caf\xe9')\n")
    assert cli.main(["run", "--gpu", "T4", "latin.py"]) == 0
    assert "caf\u00e9" in capsys.readouterr().out


# a script that takes its batch size from its command line in nanoGPT's configurator's way
# (code run with the script's globals sets a global from --name=value), written here
CONFIGURED = textwrap.dedent('''
    import sys
    import torch
    from memmagic import zoo

    batch_size = 64
    for arg in sys.argv[1:]:
        key, _, value = arg.lstrip("-").partition("=")
        if key in globals() and value:
            globals()[key] = int(value)
    model, _ = zoo.build("nanogpt", device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for it in range(1000):
        xb = torch.randint(0, 1000, (batch_size, 128), device="cuda")
        model.loss(xb, xb).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
''')


# transformers' HfArgumentParser makes --per_device_train_batch_size of TrainingArguments
TRAINER_STYLE = (TRAIN.replace('p.add_argument("--batch_size", type=int, default=8)',
                               'p.add_argument("--per_device_train_batch_size", type=int, '
                               'default=8)')
                 .replace("args.batch_size", "args.per_device_train_batch_size"))


@pytest.mark.parametrize("source,given,took", [
    (TRAIN.replace("default=8", "default=64"), [], "--batch_size=N; it ran with 64, its own default"),
    (CONFIGURED, [], "--batch_size=N; it ran with 64, its own default"),
    (TRAINER_STYLE, ["--per_device_train_batch_size", "64"],
     "--per_device_train_batch_size=N; it ran with 64, as given"),
], ids=["argparse", "configurator", "trainer"])
def test_the_doctor_finds_the_batch_option_a_script_was_not_given(source, given, took, tmp_path,
                                                                   capsys, clean_state):
    """A script that takes its batch size on its command line under a name memmagic was not
    given (argparse's default, a global its own argument loop sets, a Trainer's per-device
    batch) gets the doctor's smaller batches all the same, passed on its command line;
    argv is put back after every run."""
    path = tmp_path / "train.py"
    path.write_text(source)
    argv = list(sys.argv)
    rc = cli.main(["run", "--gpu-memory", "256MiB", "--steps", "1", str(path), *given])
    out = capsys.readouterr()
    assert rc == 1 and "out of memory" in out.err
    assert f"note: the script takes batch_size on its command line ({took})" in out.out
    rows = [line for line in out.out.splitlines() if "(from 64)" in line]
    assert rows and any(line.rstrip().endswith("fits") for line in rows), out.out
    assert "no smaller batch was tried" not in out.out
    assert sys.argv == argv


# a script whose hyperparameters are plain numbers at its top level (a lecture's train
# script), with no command-line options at all
ASSIGNED = CONFIGURED.replace("""for arg in sys.argv[1:]:
    key, _, value = arg.lstrip("-").partition("=")
    if key in globals() and value:
        globals()[key] = int(value)
""", "")


# hyperparameters in a settings dict passed to a main function (rasbt/LLMs-from-scratch's
# OTHER_SETTINGS), under the script's __main__ guard
SETTINGS_DICT = textwrap.dedent('''
    import torch
    from memmagic import zoo

    def main(settings):
        model, _ = zoo.build("nanogpt", device="cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=settings["learning_rate"])
        for it in range(1000):
            xb = torch.randint(0, 1000, (settings["batch_size"], 128), device="cuda")
            model.loss(xb, xb).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    if __name__ == "__main__":
        SETTINGS = {
            "learning_rate": 3e-4,
            "batch_size": 64,
        }
        main(SETTINGS)
''')


# a tutorial's loop over a DataLoader whose batch size is written in the call
LOADER = textwrap.dedent('''
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from memmagic import zoo

    model, _ = zoo.build("nanogpt", device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = torch.randint(0, 1000, (512, 128))
    loader = DataLoader(TensorDataset(tokens), batch_size=64, shuffle=True)
    for (xb,) in loader:
        xb = xb.cuda()
        model.loss(xb, xb).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
''')


@pytest.mark.parametrize("source,written,line", [
    (ASSIGNED, "batch_size = 64", 6), (SETTINGS_DICT, '"batch_size": 64', 17),
    (LOADER, "batch_size=64", 9)], ids=["variable", "settings dict", "loader"])
def test_the_doctor_sets_a_batch_size_the_script_sets_at_its_top_level(
        source, written, line, tmp_path, capsys, clean_state):
    """``batch_size = 64`` at the script's top level and no option, the one entry of that
    name of a settings dict written out there (``{"batch_size": 64}``), or a call's keyword
    (``DataLoader(ds, batch_size=64)``): the doctor's re-runs set smaller numbers there, in
    memory (the file stays as it is), and --whatif takes it too."""
    path = tmp_path / "train.py"
    path.write_text(source)
    rc = cli.main(["run", "--gpu-memory", "256MiB", "--steps", "1", str(path)])
    out = capsys.readouterr()
    assert rc == 1 and "out of memory" in out.err
    assert (f"note: the script sets {written} at line {line}: the doctor's re-runs set "
            "smaller ones there (in memory; the file is not changed)") in out.out
    rows = [ln for ln in out.out.splitlines() if "(from 64)" in ln]
    assert rows and any(ln.rstrip().endswith("fits") for ln in rows), out.out
    assert "no smaller batch was tried" not in out.out and "ScriptError" not in out.out
    assert path.read_text() == source
    peaks = {}
    for whatif in (["--whatif", "batch_size=8"], []):
        assert cli.main(["run", "--gpu", "T4", "--steps", "1", "--json", str(tmp_path / "r.json"),
                         *whatif, str(path)]) == 0
        fitting = capsys.readouterr().out
        peaks[bool(whatif)] = json.loads((tmp_path / "r.json").read_text())["peak"]
    assert peaks[True] < peaks[False]
    # where it fits, no doctor re-runs: the note says what --whatif does there instead
    assert (f"note: the script sets {written} at line {line}: --whatif batch_size=N sets "
            "another there (in memory; the file is not changed)") in fitting
    assert "doctor's" not in fitting


# a config of nested sections set by dotted options (minGPT's CfgNode.merge_from_args)
DOTTED = textwrap.dedent('''
    import sys
    import types
    import torch
    from memmagic import zoo

    config = types.SimpleNamespace(trainer=types.SimpleNamespace(batch_size=64, lr=3e-4))
    for arg in sys.argv[1:]:
        keys, _, value = arg.lstrip("-").partition("=")
        *path, last = keys.split(".")
        node = config
        for k in path:
            node = getattr(node, k)
        setattr(node, last, type(getattr(node, last))(value))
    model, _ = zoo.build("nanogpt", device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=config.trainer.lr)
    for it in range(1000):
        xb = torch.randint(0, 1000, (config.trainer.batch_size, 128), device="cuda")
        model.loss(xb, xb).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
''')


def test_a_batch_given_under_a_configs_dotted_key_is_the_one_the_doctor_sets(tmp_path, capsys,
                                                                             clean_state):
    path = tmp_path / "train.py"
    path.write_text(DOTTED)
    rc = cli.main(["run", "--gpu-memory", "256MiB", "--steps", "1", str(path),
                   "--trainer.batch_size=64"])
    out = capsys.readouterr().out
    assert rc == 1
    rows = [ln for ln in out.splitlines() if "(from 64)" in ln]
    assert rows and any(ln.rstrip().endswith("fits") for ln in rows), out
    assert "no smaller batch was tried" not in out and "ScriptError" not in out


def test_a_top_level_number_the_script_changes_later_is_said_not_measured(tmp_path, capsys,
                                                                          clean_state):
    path = tmp_path / "train.py"
    path.write_text(ASSIGNED.replace("model, _ =", "def fix():\n    global batch_size\n"
                                     "    batch_size = 64\nfix()\nmodel, _ ="))
    assert cli.main(["run", "--gpu-memory", "256MiB", "--steps", "1", str(path)]) == 1
    out = capsys.readouterr().out
    assert ("failed: ScriptError: the script changed batch_size after line 6 (memmagic set "
            "batch_size = 32 there)") in out, out


def test_a_batch_option_the_script_does_not_take_is_said_not_measured(tmp_path, capsys,
                                                                      clean_state):
    """A script that reads its arguments and has a batch_size global, but ignores
    --batch_size=N: each re-run that passed it says so, and no row claims that batch."""
    path = tmp_path / "train.py"
    path.write_text(CONFIGURED.replace("if key in globals() and value:",
                                       "if key == 'lr' and value:"))
    rc = cli.main(["run", "--gpu-memory", "256MiB", "--steps", "1", str(path)])
    out = capsys.readouterr()
    assert rc == 1
    rows = [line for line in out.out.splitlines() if "(from 64)" in line]
    assert rows and not any(line.rstrip().endswith("fits") for line in rows), out.out
    assert "failed: ScriptError: the script did not take --batch_size=" in out.out, out.out
    assert "cell" not in out.out.lower()

