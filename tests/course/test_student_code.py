"""The code students really write, as the defects found in it were reproduced (issue 23):
each test failed on the code before its fix."""

from __future__ import annotations

import pytest
import torch
from IPython.core.error import UsageError

MiB = 1 << 20

MODEL = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
x = torch.randn(4096, 256, device="cuda")
"""

OWN_AMP = """
with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
    loss = model(x).float().pow(2).mean()
loss.backward()
"""


def _sim_model(ip):
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell(MODEL)


# -- 2: a knob's value takes the type of the cell's own variable -------------------------
def test_a_flag_of_the_cells_own_gets_true_or_false(ip):
    _sim_model(ip)
    ip.run_cell("amp = False")
    panel = ip.run_cell_magic("gpumem", "--whatif -o -q", OWN_AMP)
    assert panel.baseline_report.error is None and panel.baseline.amp == "off"
    assert "amp" in panel.controls
    fp32 = panel.report.peak
    panel.set(amp="fp16")
    assert panel.error is None and panel.report.error is None
    assert panel.report.peak < fp32  # the fp16 activations are half the size
    assert ip.user_ns["amp"] is False  # the notebook's own variable is untouched


def test_a_flag_that_is_on_is_the_baseline(ip):
    _sim_model(ip)
    ip.run_cell("amp = True")
    panel = ip.run_cell_magic("gpumem", "--whatif -o -q", OWN_AMP)
    assert panel.baseline.amp == "fp16" and panel.baseline_report.error is None
    on = panel.report.peak
    panel.set(amp="off")
    assert panel.report.error is None and panel.report.peak > on


def test_a_variable_the_cell_fails_with_falls_back_to_memmagic_applying_the_knob(ip):
    _sim_model(ip)
    ip.run_cell('amp = "float16"')  # a name of the cell's own, which memmagic cannot follow
    own = OWN_AMP.replace("dtype=torch.float16, enabled=amp", "dtype=getattr(torch, amp)")
    panel = ip.run_cell_magic("gpumem", "--whatif -o -q", own)
    assert panel.baseline_report.error is None
    assert any(n.startswith("memmagic applies amp itself: the cell failed with its own "
                            "variables") for n in panel.baseline_report.notes)
    panel.set(amp="bf16")
    assert panel.report.error is None and "amp bf16" in panel.setting.label()


# -- 7: a trailing ";" silences the cell's value ------------------------------------------
def test_a_trailing_semicolon_silences_the_value(ip, capsys):
    ip.run_cell(MODEL.replace(".cuda()", "").replace(', device="cuda"', ""))
    ip.run_cell_magic("gpumem", "--backend sim --no-chart", "model.train();")
    ip.run_cell_magic("gpumem", "--backend sim --no-chart", "model.train()  # shown")
    out = capsys.readouterr().out
    assert out.count("Sequential(") == 1


# -- 8: a module class that matches nothing is a one-line error ---------------------------
def test_checkpointing_a_class_that_is_not_there_names_what_is(ip):
    _sim_model(ip)
    with pytest.raises(UsageError, match=r"--checkpointing NoSuchModule: no module of class "
                                         r"NoSuchModule in Sequential; its module classes: "
                                         r"GELU, Linear$"):
        ip.run_cell_magic("gpumem", "--checkpointing NoSuchModule -q", "model(x).sum().backward()")
    r = ip.run_cell_magic("gpumem", "--checkpointing Linear -o -q", "model(x).sum().backward()")
    assert r.error is None and any(n.startswith("checkpointing: 2 block(s) (Linear)")
                                   for n in r.notes)


# -- 10: an out of memory with a literal batch says how to let the doctor try smaller ones --
def test_an_oom_with_a_literal_batch_says_how_to_try_smaller_batches(ip):
    _sim_model(ip)
    r = ip.run_cell_magic("gpumem", "--no-raise -o -q",
                          "y = torch.randn(1 << 22, 256, device='cuda')\nmodel(y).sum().backward()")
    assert r.failed_request is not None and r.advice is not None
    assert not any("batch" in s.knobs for s in r.advice.strategies)
    assert any(n.startswith("no smaller batch was tried: the cell makes its batch with a "
                            "fixed size") for n in r.advice.notes)


# -- 11: %gpusim on at the top of a cell with code ------------------------------------------
def test_gpusim_on_at_the_top_of_a_cell_simulates_its_code_too(ip):
    r = ip.run_cell("%gpusim on --gpu T4\nimport torch\nx = torch.ones(1024, device='cuda')\n",
                    store_history=True)
    assert r.error_in_exec is None and "x" in ip.user_ns
    after = ip.run_cell_magic("gpumem", "-o -q", "y = 1")
    assert after.backend == "sim" and after.before == 4096  # x is on the simulated card


def test_gpusim_on_in_a_cell_transformed_before_it_was_loaded_refuses_the_rest(ip):
    ip.run_line_magic("unload_ext", "memmagic")
    r = ip.run_cell("%load_ext memmagic\n%gpusim on --gpu T4\nx = torch.ones(4, device='cuda')",
                    store_history=True)
    assert isinstance(r.error_in_exec, UsageError)
    assert "the code after it in this cell did not run" in str(r.error_in_exec)
    assert "x" not in ip.user_ns
    again = ip.run_cell("%load_ext memmagic\n%gpusim on --gpu T4\nx = torch.ones(4, device='cuda')",
                        store_history=True)
    assert again.error_in_exec is None and "x" in ip.user_ns  # made on the simulated GPU


# -- 4: a panel moved or a Cell run in a cell of its own under %gpusim on ----------------
def test_a_cell_of_memmagic_objects_runs_for_real_under_gpusim(ip):
    _sim_model(ip)
    ip.run_cell("amp = False")
    panel = ip.run_cell_magic("gpumem", "--whatif -o -q", OWN_AMP)
    ip.user_ns["panel"] = panel
    r = ip.run_cell("report = panel.cell.run(amp='bf16')\npanel.set(amp='fp16')\nreport")
    assert r.error_in_exec is None and r.result.error is None
    assert r.result.backend == "sim" and panel.setting.amp == "fp16" and panel.error is None
    # code that uses the simulated objects too is a simulated cell: a run inside is refused,
    # with what to do
    mixed = ip.run_cell("y = model(x)\npanel.cell.run(amp='bf16')")
    assert "%gpusim off" in str(mixed.error_in_exec)


# -- the corpus's GradScaler recipe under --grad-mode no_grad ------------------------------
SCALER_STEP = """
opt.zero_grad(set_to_none=True)
with torch.autocast("cuda", dtype=torch.float16):
    loss = model(x).float().pow(2).mean()
scaler.scale(loss).backward()
scaler.step(opt)
scaler.update()
"""


def test_a_grad_scaler_step_is_skipped_with_the_backward(ip):
    _sim_model(ip)
    ip.run_cell("opt = torch.optim.AdamW(model.parameters())\nscaler = torch.amp.GradScaler('cuda')")
    train = ip.run_cell_magic("gpumem", "-o -q", SCALER_STEP)
    assert train.error is None and train.breakdown["activations"] > 0
    r = ip.run_cell_magic("gpumem", "--grad-mode no_grad -o -q", SCALER_STEP)
    assert r.error is None and r.breakdown["activations"] == 0
    assert any("GradScaler steps were skipped" in n for n in r.notes)
    assert torch.amp.GradScaler.step.__name__ == "step"  # put back after the run


# -- the corpus's cases 06 and 25: checkpointing a transformers model --------------------
GPT2 = """
from transformers import GPT2Config, GPT2LMHeadModel
model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=2,
                                   n_head=2, bos_token_id=0, eos_token_id=0)).to("cuda")
ids = torch.randint(0, 512, (4, 128), device="cuda")
"""


@pytest.mark.slow
def test_checkpointing_a_transformers_model_uses_its_own_switch(ip):
    # wrapped from outside, each GPT2Block appended its keys and values to the KV cache
    # again in the recompute (256 -> 512 positions: CheckpointError); the model's own
    # switch turns the cache off in training, as a user's gradient_checkpointing_enable does
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell(GPT2)
    panel = ip.run_cell_magic("gpumem", "--whatif -o -q", "model(ids, labels=ids).loss.backward()")
    base = panel.report.peak
    panel.set(checkpointing=True)
    assert panel.error is None and panel.report.error is None, panel.error
    assert panel.report.peak < base
    assert any("activation_checkpointing_enable()" in n and "2 block(s) (GPT2Block)" in n
               for n in panel.report.notes), panel.report.notes
    panel.set(checkpointing=False)
    assert panel.report.peak == base
    # the notebook's model is as it was: no checkpointing left switched on
    assert ip.run_cell("assert not model.is_activation_checkpointing").error_in_exec is None
    ip.run_line_magic("gpusim", "off")


def test_a_knob_value_given_as_a_value_not_as_option_text(ip):
    import memmagic

    _sim_model(ip)
    ns = ip.user_ns
    r = memmagic.run_cell(memmagic.CellRequest(
        "model(x).sum().backward()", ns, backend="sim", gpu="T4",
        session=ip._memmagic_sim_session, knobs={"checkpointing": True}))
    assert r.error is None  # was AttributeError: 'bool' object has no attribute 'lower'


def test_a_whatif_copy_keeps_the_lr_schedulers_mark_on_its_optimizer(ip, recwarn):
    _sim_model(ip)
    ip.run_cell("opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "sched = torch.optim.lr_scheduler.StepLR(opt, 1)")
    panel = ip.run_cell_magic("gpumem", "--whatif -o -q",
                              "model(x).sum().backward()\nopt.step()\nsched.step()")
    assert panel.report.error is None
    assert not [w for w in recwarn if "optimizer.step()` has been overridden" in str(w.message)]


def test_importing_bitsandbytes_in_a_simulated_cell_loads_its_cpu_build(ip):
    pytest.importorskip("bitsandbytes")  # (installed with the test extras)
    import subprocess
    import sys
    # a fresh process: bitsandbytes (as peft and transformers import it) first imported
    # inside a simulation saw torch.cuda.is_available() True and loaded its CUDA backend,
    # which failed on torch._C._cuda_getCurrentRawStream
    code = ("import IPython, torch\n"
            "from IPython.testing.globalipapp import start_ipython\n"
            "ip = start_ipython()\nip.run_line_magic('load_ext', 'memmagic')\n"
            "ip.run_line_magic('gpusim', 'on --gpu T4')\n"
            "r = ip.run_cell('import bitsandbytes, peft')\n"
            "assert r.error_in_exec is None, r.error_in_exec\n"
            "ip.run_line_magic('gpusim', 'off')\n"
            "assert torch.cuda.is_available() is False\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


# -- the corpus's case 02: bf16 weights in an evaluation loop ------------------------------
def test_weights_dtype_on_a_real_backend_leaves_the_users_model_as_it_was(ip):
    ip.run_cell("m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))\n"
                "w, bn = m[0].weight, m[1].running_mean\nx = torch.randn(8, 64)")
    r = ip.run_cell_magic("gpumem", "--backend cpu --weights-dtype bf16 -o -q", "y = m(x)")
    assert r.error is None and ip.user_ns["y"].dtype == torch.bfloat16
    # the same objects with their fp32 data (it was converted for good before the fix)
    m = ip.user_ns["m"]
    assert m[0].weight is ip.user_ns["w"] and m[0].weight.dtype == torch.float32
    assert m[1].running_mean is ip.user_ns["bn"] and m[1].running_mean.dtype == torch.float32
    assert any("put back after the run" in n for n in r.notes)


def test_bf16_weights_halve_a_no_grad_loops_parameters_in_the_whatif_panel(ip):
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell("model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),\n"
                "                            torch.nn.Linear(4096, 1024)).cuda()\n"
                "x = torch.randn(64, 1024, device='cuda')")
    panel = ip.run_cell_magic("gpumem", "--whatif -o -q", "with torch.no_grad():\n    y = model(x)")
    base = panel.report
    panel.set(weights_dtype="bf16")
    r = panel.report
    fp32 = 2 * (1024 * 4096 * 4) + 4096 * 4 + 1024 * 4
    assert base.breakdown["parameters"] == fp32
    # converted before the measurement, as if loaded in bf16: half the bytes, and no fp32
    # copy on top (the conversion's own transient counted before: the peak went up)
    assert r.breakdown["parameters"] == fp32 // 2
    assert r.before == fp32 // 2 + 64 * 1024 * 4  # and x
    assert r.peak < base.peak
    assert ip.run_cell("assert model[0].weight.dtype == torch.float32").error_in_exec is None


def test_random_indices_are_drawn_for_real_so_slicing_by_them_keeps_shapes(ip):
    # nanoGPT's get_batch: data[i:i + block_size] for i in torch.randint(...): each i and
    # i + block_size were placeholders (0 and 0), and every slice came out empty
    ip.run_line_magic("gpusim", "on --gpu T4")
    r = ip.run_cell("data = torch.randint(0, 100, (10_000,))\n"
                    "ix = torch.randint(len(data) - 64, (8,))\n"
                    "X = torch.stack([data[i:i + 64] for i in ix]).to('cuda')\n"
                    "perm = torch.randperm(16, device='cuda')\n"
                    "assert X.shape == (8, 64), X.shape\n"
                    "assert sorted(perm.tolist()) == list(range(16))")
    assert r.error_in_exec is None, r.error_in_exec


class _Unconvertible(torch.nn.Linear):
    def _apply(self, fn, recurse=True):  # a .to() that fails, as an OOM in the conversion would
        raise RuntimeError("this model cannot be converted")


def test_a_failed_knob_setup_is_the_runs_error_on_a_real_backend(clean_state):
    from memmagic import Cell

    m = _Unconvertible(8, 8)
    r = Cell("y = m(x)", {"m": m, "x": torch.randn(2, 8)}, backend="cpu").run(weights_dtype="bf16")
    # the setup runs before the measurement; its error is the report's, as in the sim
    assert r.error is not None and "this model cannot be converted" in r.error
    assert m.weight.dtype == torch.float32


# -- what a failed step's names hold after an out of memory (corpus case 04) ----------------
def _allocated(ip) -> int:
    ip.run_cell("_a = torch.cuda.memory_allocated()")
    return ip.user_ns["_a"]


LSTM = """
import torch
lstm = torch.nn.LSTM(256, 1024, 2, batch_first=True).cuda()
head = torch.nn.Linear(1024, 96).cuda()
x = torch.randn(32, 32, 256, device="cuda")
"""

LSTM_STEP = """
out, state = lstm(x)
loss = head(out).float().pow(2).mean()
loss.backward()
"""


def _backward_fails(ip) -> int:
    """The setup on a T4, and a card (MiB) between the forward's peak and the step's."""
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell(LSTM)
    forward = LSTM_STEP.replace("loss.backward()", "")
    f = ip.run_cell_magic("gpumem", "--backend sim --gpu T4 -o -q --no-chart", forward).peak
    b = ip.run_cell_magic("gpumem", "--backend sim --gpu T4 -o -q --no-chart", LSTM_STEP).peak
    assert b > f + 8 * MiB
    return (f + b) // 2 // MiB


def test_after_an_oom_the_report_names_the_del_that_frees_what_the_step_left(ip, capsys):
    # the backward fails: `out`, `state` and `loss` hold the step's autograd graph, as on
    # a GPU (re-running the setup does not free it); the report's `del` line frees exactly
    # what it says
    oom = ip.run_cell_magic("gpumem", f"--gpu-memory {_backward_fails(ip)}MiB --no-raise -o -q",
                            LSTM_STEP)
    assert oom.failed_request is not None
    desc = oom.advice.oom
    assert set(desc.left) == {"out", "state", "loss"} and desc.left_bytes > 0
    assert desc.del_line.startswith("del ") and "re-running earlier cells does not" in str(desc)
    held = _allocated(ip)
    ip.run_cell(desc.del_line)
    assert held - _allocated(ip) == desc.left_bytes
    # what remains is the model, the batch and the gradients the backward had made
    assert "lstm" in ip.user_ns and "x" in ip.user_ns


def test_the_oom_line_says_which_names_to_delete(ip, capsys):
    ip.run_cell_magic("gpumem", f"--gpu-memory {_backward_fails(ip)}MiB --no-raise --no-chart",
                      LSTM_STEP)
    err = " ".join(capsys.readouterr().err.split())
    assert "which this cell assigns, still hold" in err and "`del " in err, err


# -- a view of an earlier cell's small tensor (corpus case 04's `text[:, i:i + 32]`) -------
def test_a_view_of_an_earlier_cells_tensor_takes_no_memory(ip):
    # small factory outputs carry their values (constants); FakeTensorMode made views of
    # them on storages of their own once its memo was emptied at a cell's start
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell("import torch\ntext = torch.zeros(32, 97, device='cuda', dtype=torch.long)")
    one = _allocated(ip)
    assert one == 25088  # 32 x 97 x 8 B = 24,832 B, in 512-byte blocks
    ip.run_cell("x, y = text[:, 0:32], text[:, 1:33]\nrows = text.unbind(0)\nflat = text.view(-1).t()")
    assert _allocated(ip) == one
    ip.run_cell("assert x.untyped_storage().nbytes() == 24832\nok = int(x[0, 0] + rows[3][5])")
    assert ip.user_ns["ok"] == 0
    ip.run_cell("text[0, 0] = 7")  # a write through the base reaches the views' values
    ip.run_cell("seen = int(x[0, 0])")
    assert ip.user_ns["seen"] == 7
    ip.run_cell("del text, x, y, rows, flat")
    assert _allocated(ip) == 0


def test_the_del_line_counts_the_cards_memory_not_the_hosts(ip):
    # a batch still on the CPU is fake on the simulated GPU's host too: `del` of it frees
    # nothing on the card, so it is neither named nor counted
    ip.run_line_magic("gpusim", "on --gpu T4")
    oom = ip.run_cell_magic("gpumem", "--gpu-memory 64MiB --no-raise -o -q",
                            "host = torch.randn(1024, 1024)\n"
                            "x = torch.randn(1024, 1024, device='cuda')\n"
                            "y = torch.randn(64, 1024, 1024, device='cuda')")
    desc = oom.advice.oom
    assert desc.left == ("x",) and desc.left_bytes == 4 * MiB
    held = _allocated(ip)
    ip.run_cell(desc.del_line)
    assert held - _allocated(ip) == 4 * MiB
