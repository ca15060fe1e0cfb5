"""The simulated GPU against the real one (issue 21): the figures an H100 gave
(``results/gpu-check-*.json``, from ``python -m benchmarks.gpu_check --real``) pinned here,
so the simulation keeps matching them without a GPU."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check
from memmagic.backends.sim.gpus import cuda_context, resolve_target
from memmagic.backends.sim.kernels import attention_backward_scratch, cudnn_lstm_reserve
from memmagic.backends.sim.workspaces import reduction_scratch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results" / "gpu-check-nvidia-h100-80gb-hbm3.json"
H100 = json.loads(RESULTS.read_text(encoding="utf-8"))
SMS = H100["versions"]["multiprocessors"]

# Checks the simulation still misses, and why (docs/fidelity.md lists them with
# their sizes): cuDNN's convolution workspaces (the algorithm cuDNN picks decides their size),
# cuDNN's transient RNN workspace, GradScaler skipping both steps on the real GPU (inf
# gradients at the first scales: no AdamW state), and the reserved memory of two cases not
# yet explained.
KNOWN_MISSES = {
    **{f"cnn {p}{c}": "cuDNN convolution workspaces" for p in ("fp32", "fp16", "bf16")
       for c in ("", " ckpt")},
    **{f"lstm {p}{c}": "cuDNN's RNN workspace" for p in ("fp32", "fp16", "bf16")
       for c in ("", " ckpt")},
    "resnet fp32": "cuDNN convolution workspaces",
    "resnet bf16": "cuDNN convolution workspaces",
    "resnet fp16": "GradScaler skipped both real steps",
    "llama fp16": "reserved memory 6% low, not yet explained",
    "llama bf16": "reserved memory 6% low, not yet explained",
}


def _within(sim: dict, real: dict) -> bool:
    ea = sim["step_max_alloc"] / real["step_max_alloc"] - 1
    er = sim["step_max_reserved"] / real["step_max_reserved"] - 1
    return abs(ea) <= gpu_check.ALLOCATED_TARGET and abs(er) <= gpu_check.RESERVED_TARGET


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[n])) if n in KNOWN_MISSES
    else n for n in H100["real"]])
def test_simulation_matches_the_real_h100(name):
    """Known misses must still miss (strict): a fixed one leaves the list and docs/fidelity.md's."""
    check = next(c for c in gpu_check.CHECKS if c.name == name)
    real = H100["real"][name]
    sim = gpu_check.sim_run(check, {"gpu": "H100-80GB"})
    assert sim["error"] is None, sim["error"]
    assert _within(sim, real), (
        f"allocated {sim['step_max_alloc']:,} vs {real['step_max_alloc']:,}, "
        f"reserved {sim['step_max_reserved']:,} vs {real['step_max_reserved']:,}")


# -- the kernels' own buffers, to the byte -------------------------------------------------------
# (outputs, rows) of a bias gradient's column sum -> its staging buffer, read off the H100's
# allocation history (results/gpu-check-traces-*.json.gz): BERT-base, ViT-B/16, GPT-2 and the
# zoo's transformer in the GPU check
COLUMN_SUMS = [((768, 4096), 25_165_824), ((3072, 4096), 100_663_296), ((256, 16384), 33_554_432),
               ((1024, 16384), 134_217_728), ((768, 16384), 100_663_296), ((768, 6304), 38_928_384),
               ((3072, 6304), 138_412_032), ((2304, 4096), 75_497_472)]


@pytest.mark.parametrize("shape,staging", COLUMN_SUMS)
def test_reduction_staging_buffer_is_the_h100s(shape, staging):
    outputs, rows = shape
    got = reduction_scratch((rows, outputs), (outputs, 1), {0}, 4, SMS)
    assert got == [staging, 4 * -(-outputs // 128)]  # and a semaphore per column of blocks


def test_reductions_without_a_global_stage_take_nothing():
    assert reduction_scratch((4096, 768), (768, 1), {1}, 4, SMS) == []  # over the inner dim
    assert reduction_scratch((64, 768), (768, 1), {0}, 4, SMS) == []    # few rows a column
    assert reduction_scratch((4096, 768), (768, 1), {0}, 4, 0) == []    # a card of unknown SMs


def _allocs(events):
    return [size for action, size in events if action == "alloc"]


@pytest.mark.parametrize("row", [r for r in H100["kernels"]["sdpa"] if r.get("choice") in (2, 3)],
                         ids=lambda r: f"{r['dtype']}-B{r['B']}H{r['H']}L{r['L']}D{r['D']}-p{r['dropout']}-m{int(r['mask'])}")
def test_attention_backward_buffers_are_the_h100s(row):
    B, H, L, D = row["B"], row["H"], row["L"], row["D"]
    el = {"fp16": 2, "bf16": 2, "fp32": 4}[row["dtype"]]
    grad = B * L * H * D * el  # dq, dk, dv
    backend = {2: "efficient", 3: "cudnn"}[row["choice"]]
    expected = [grad] * 3 + attention_backward_scratch(backend, B, H, L, D, grad)
    assert sorted(_allocs(row["backward"])) == sorted(expected)


@pytest.mark.parametrize("row", [r for r in H100["kernels"]["rnn"] if r["mode"] == "LSTM"],
                         ids=lambda r: f"{r['dtype']}-L{r['layers']}-bi{int(r['bidirectional'])}-B{r['B']}T{r['T']}H{r['H']}")
def test_lstm_reserve_is_cudnns(row):
    """cuDNN's reserve (the forward's last allocation) is the layers' own reserves plus the
    inner layers' outputs (the next layer's saved input in the simulation) and 256 bytes."""
    B, T, H, L = row["B"], row["T"], row["H"], row["layers"]
    dirs = 2 if row["bidirectional"] else 1
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[row["dtype"]]
    x = torch.empty((T, B, row["I"]), dtype=dtype, device="meta")
    layer = cudnn_lstm_reserve((x, *([None] * 9), H, None, None, None, None, True))
    inner_outputs = (L - 1) * dirs * T * B * H * x.element_size()
    assert _allocs(row["forward"])[-1] == L * dirs * layer + inner_outputs + 256


def test_h100_context_is_the_measured_one():
    stages = {s["stage"]: s["context"] for s in H100["context"]["lazy"]["stages"]}
    h100 = resolve_target("H100")
    assert h100.total_memory == H100["versions"]["total_memory"]
    assert cuda_context(h100, {}).nbytes == stages["first SDPA (fp16)"]
    eager = {s["stage"]: s["context"] for s in H100["context"]["eager"]["stages"]}
    assert cuda_context(h100, {"CUDA_MODULE_LOADING": "EAGER"}).nbytes == eager["first autocast fp16 Linear"]


SDPA_CELL = """
import torch
import torch.nn.functional as F
q, k, v = (torch.randn(16, 256, 12, 64, device="cuda", dtype=torch.float16).transpose(1, 2)
           for _ in range(3))
out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
stride = list(out.stride())
"""


@pytest.mark.parametrize("gpu,backend", [("H100", "cudnn"), ("A100", "flash")])
def test_sdpa_picks_and_lays_out_as_the_gpu(gpu, backend):
    from memmagic.backends import get_backend

    out = get_backend("sim", gpu=gpu).execute(lambda ns: (exec(SDPA_CELL, ns), ns["stride"])[1], {})
    assert out.error is None, out.error
    probe = next(r for r in H100["kernels"]["sdpa"] if (r["dtype"], r["B"], r["L"], r["dropout"], r["mask"])
                 == ("fp16", 16, 256, 0.0, False))
    assert out.value == probe["out_stride"]  # (B, L, H, D) in memory, as the kernels write it
    assert any(f"{backend} 1x" in n for n in out.report.notes), out.report.notes


def test_docs_fidelity_page_is_the_results_file():
    """docs/fidelity.md holds what `python -m benchmarks.gpu_check --docs` writes."""
    assert gpu_check.FIDELITY_PAGE == ROOT / "docs" / "fidelity.md"
    text = gpu_check.FIDELITY_PAGE.read_text(encoding="utf-8")
    start = text.index(gpu_check.FIDELITY_START) + len(gpu_check.FIDELITY_START) + 1
    assert text[start:text.index(gpu_check.FIDELITY_END)] == gpu_check.fidelity_markdown(H100)


@pytest.mark.parametrize("option", ["--docs", "--readme"])  # --readme: the option's old name
def test_gpu_check_writes_the_tables_between_the_markers(option, tmp_path):
    page = tmp_path / "fidelity.md"
    page.write_text(f"# Fidelity\n\n{gpu_check.FIDELITY_START}\nold\n{gpu_check.FIDELITY_END}\n\nafter\n")
    assert gpu_check.main([option, str(page), "--merge", str(RESULTS)]) == 0
    assert page.read_text() == (f"# Fidelity\n\n{gpu_check.FIDELITY_START}\n"
                                f"{gpu_check.fidelity_markdown(H100)}{gpu_check.FIDELITY_END}\n\nafter\n")
