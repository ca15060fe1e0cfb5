"""A student's notebook on the simulated GPU: %gpusim, and %%gpumem cells that share it.

The first tests use IPython in-process (the ``ip`` fixture); the last runs a three-cell
notebook through a real Jupyter kernel with nbclient, as a student's "Run All" would.
"""

from __future__ import annotations

import nbformat
import pytest
import torch
from nbclient import NotebookClient

from memmagic.backends.sim import SimulatedValue

SETUP = """\
import torch, torch.nn as nn
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
opt = torch.optim.AdamW(model.parameters())
"""
TRAIN = """\
for step in range(2):
    x = torch.randn(64, 512, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
allocated = torch.cuda.memory_allocated()
"""
EVAL = """\
model.eval()
with torch.no_grad():
    n_correct = (model(torch.randn(16, 512, device=device)).argmax(1) == 0).sum()
"""
PARAMS = 512 * 512 * 4 + 512 * 4 + 512 * 10 * 4 + 512  # 10 fp32 biases round up to 512 B


def test_gpumem_sim_cells_share_one_simulated_gpu(ip):
    r1 = ip.run_cell_magic("gpumem", "--backend sim --gpu T4 -o -q --no-chart", SETUP)
    assert r1.error is None and r1.after == PARAMS
    assert ip.user_ns["device"].type == "cuda"
    assert isinstance(ip.user_ns["model"], SimulatedValue)
    r2 = ip.run_cell_magic("gpumem", "--backend sim --gpu T4 -o -q --no-chart", TRAIN)
    assert r2.error is None, r2.error
    assert r2.before == PARAMS and ip.user_ns["allocated"] == r2.after >= 4 * PARAMS
    r3 = ip.run_cell_magic("gpumem", "--backend sim --gpu T4 -o -q --no-chart", EVAL)
    assert r3.error is None, r3.error
    assert r3.before == r2.after
    ip.run_line_magic("gpusim", "reset")


def test_gpusim_switch_runs_every_cell_simulated(ip, capsys):
    ip.run_line_magic("gpusim", "on --gpu T4")
    try:
        assert not ip.run_cell(SETUP).error_in_exec
        res = ip.run_cell(TRAIN)
        assert res.error_in_exec is None, res.error_in_exec
        out = capsys.readouterr().out
        # one footer line per cell: allocated, peak in the cell, reserved, the card
        footers = [ln for ln in out.splitlines() if ln.startswith("[sim: simulated cuda:0 (T4)]")]
        assert len(footers) == 2 and "fits T4" in footers[1] and "peak" in footers[1]
        assert ip.user_ns["allocated"] >= 4 * PARAMS
        # %%gpumem in the mode: the full report, against the same simulated GPU
        r = ip.run_cell_magic("gpumem", "-o -q --no-chart", "z = torch.cuda.memory_allocated()")
        assert r.backend == "sim" and r.before == ip.user_ns["allocated"]
        # a magic-only cell is not simulated
        assert not ip.run_cell("%gpusim").error_in_exec
        assert "simulated GPU (T4)" in capsys.readouterr().out
    finally:
        ip.run_line_magic("gpusim", "off")
        ip.run_line_magic("gpusim", "reset")
    # off: cells run for real again, and a simulated object says so in one line
    res = ip.run_cell("model.train()")
    assert "simulated GPU" in str(res.error_in_exec)
    res = ip.run_cell("w = 1 + 1")
    assert res.error_in_exec is None and ip.user_ns["w"] == 2


def test_a_cell_whose_function_takes_a_parameter_named_as_the_model_is_simulated(ip, capsys):
    """``def largest_grad(model): ...`` then ``largest_grad(model)`` reads the notebook's
    ``model``: the cell runs on the simulated GPU (a function's parameter does not hide the
    name it is called with)."""
    ip.run_line_magic("gpusim", "on --gpu T4")
    try:
        assert not ip.run_cell(SETUP).error_in_exec
        res = ip.run_cell("def count(model):\n"
                          "    return sum(p.numel() for p in model.parameters())\n"
                          "n = count(model)\n")
        assert res.error_in_exec is None, res.error_in_exec
        assert ip.user_ns["n"] == 512 * 512 + 512 + 512 * 10 + 10
        assert "[sim: simulated cuda:0 (T4)]" in capsys.readouterr().out
    finally:
        ip.run_line_magic("gpusim", "off")
        ip.run_line_magic("gpusim", "reset")


def test_gpusim_off_on_top_of_a_cell_runs_it_for_real_and_on_resumes_the_card(ip, capsys):
    """A student's "%gpusim off" above code runs that code for real (as "%gpusim on" above
    code simulates it), and a later bare "%gpusim on" goes back to the card of before with
    what it holds; "--gpu none" is no target card."""
    ip.run_line_magic("gpusim", "on --gpu T4")
    try:
        assert not ip.run_cell(SETUP).error_in_exec
        capsys.readouterr()
        res = ip.run_cell("%gpusim off\nw = 1 + 1")
        out = capsys.readouterr().out
        assert res.error_in_exec is None and ip.user_ns["w"] == 2
        assert "cells run for real" in out and "[sim:" not in out
        assert not ip._memmagic_sim_mode.on
        ip.run_line_magic("gpusim", "on")
        assert "T4 (14.74 GiB) as before" in capsys.readouterr().out
        assert not ip.run_cell("z = torch.cuda.memory_allocated()").error_in_exec
        assert "[sim: simulated cuda:0 (T4)]" in capsys.readouterr().out
        assert ip.user_ns["z"] == PARAMS  # the model is still on the card
        ip.run_line_magic("gpusim", "on --gpu none")
        assert "no target card" in capsys.readouterr().out
    finally:
        ip.run_line_magic("gpusim", "off")
        ip.run_line_magic("gpusim", "reset")


def test_gpusim_bad_input_is_one_line(ip):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="usage: %gpusim"):
        ip.run_line_magic("gpusim", "sideways")
    with pytest.raises(UsageError, match="--gpu"):
        ip.run_line_magic("gpusim", "on --gpu NoSuchCard")
    with pytest.raises(UsageError, match="--gpu-memory 6GiB"):   # the option as typed
        ip.run_line_magic("gpusim", "on --gpu-memory 6")
    assert not ip._memmagic_sim_mode.on


def test_reload_ext_keeps_gpusim_on_with_its_card_and_objects(ip, capsys):
    """%reload_ext memmagic under %gpusim on (issue 36, item 7): the mode stays on, on the
    same card, with what it holds; %unload_ext then %load_ext starts with the mode off."""
    ip.run_line_magic("gpusim", "on --gpu T4")
    try:
        assert not ip.run_cell(SETUP).error_in_exec
        ip.run_line_magic("reload_ext", "memmagic")
        mode = ip._memmagic_sim_mode
        assert mode.on and mode.gpu == "T4"
        capsys.readouterr()
        assert not ip.run_cell("z = torch.cuda.memory_allocated()").error_in_exec
        assert "[sim: simulated cuda:0 (T4)]" in capsys.readouterr().out
        assert ip.user_ns["z"] == PARAMS and isinstance(ip.user_ns["model"], SimulatedValue)
        ip.run_line_magic("unload_ext", "memmagic")
        ip.run_line_magic("load_ext", "memmagic")
        assert not mode.on and mode.gpu is None
    finally:
        ip.run_line_magic("gpusim", "off")
        ip.run_line_magic("gpusim", "reset")


def test_gpusim_on_with_a_quoted_card_on_top_of_a_cell(ip):
    r = ip.run_cell('%gpusim on --gpu "T4"\nx = torch.ones(1024, device="cuda")\n',
                    store_history=True)
    try:
        assert r.error_in_exec is None, r.error_in_exec
        assert ip._memmagic_sim_mode.gpu == "T4"
        assert ip.run_cell_magic("gpumem", "-o -q", "y = 1").before == 4096  # x on the card
    finally:
        ip.run_line_magic("gpusim", "off")
        ip.run_line_magic("gpusim", "reset")


def test_a_card_name_with_a_space_in_quotes_works_in_later_cells(ip):
    ip.run_cell('%gpusim on --gpu "RTX 4090"')
    try:
        r = ip.run_cell('x = torch.ones(1024, device="cuda")')
        assert r.error_in_exec is None and r.error_before_exec is None
        assert ip._memmagic_sim_session.card.target.name == "RTX4090"
        report = ip.run_cell_magic("gpumem", '-o -q --gpu "A100 80GB"', "y = 1")
        assert "A100-80GB" in report.device
    finally:
        ip.run_line_magic("gpusim", "off")
        ip.run_line_magic("gpusim", "reset")


def test_a_checkpoint_saved_in_one_simulated_cell_loads_in_the_next(ip, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ip.run_line_magic("gpusim", "on --gpu T4")
    try:
        ip.run_cell("m = torch.nn.Linear(8, 4).cuda()\ntorch.save(m.state_dict(), 'ckpt.pt')")
        r = ip.run_cell("sd = torch.load('ckpt.pt')\nshape = tuple(sd['weight'].shape)")
        assert r.error_in_exec is None, r.error_in_exec
        ip.run_line_magic("gpusim", "off")
        assert ip.user_ns["shape"] == (4, 8) and not (tmp_path / "ckpt.pt").exists()
        # a real file written there since is what a later simulated load reads
        torch.save({"real": torch.ones(2)}, tmp_path / "ckpt.pt")
        ip.run_line_magic("gpusim", "on")
        r = ip.run_cell("keys = sorted(torch.load('ckpt.pt'))")
        assert r.error_in_exec is None and ip.user_ns["keys"] == ["real"]
    finally:
        ip.run_line_magic("gpusim", "off")
        ip.run_line_magic("gpusim", "reset")


@pytest.mark.slow
def test_a_student_notebook_runs_all_on_the_simulated_gpu(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        "%load_ext memmagic\n%gpusim on --gpu T4",
        SETUP, TRAIN, EVAL,
        "print(allocated, n_correct.shape)",
    )]
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", "") + str(out.get("data", {}).get("text/plain", "")))
    joined = "\n".join(texts)
    assert "error" not in [o.get("output_type") for c in nb.cells for o in c.get("outputs", [])]
    assert joined.count("[sim: simulated cuda:0 (T4)]") == 4  # SETUP, TRAIN, EVAL, print
    assert "torch.Size([])" in joined  # n_correct lives on the simulated GPU between cells
