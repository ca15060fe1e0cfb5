"""Training scripts as people copy them from the most-used public repositories (what
tests/course/corpus/ does for notebook cells, as whole files): each file in ``tests/course/scripts/`` is written here in the style
of one of them (its docstring says which, and what it exercises) and runs unchanged

1. through the command line, ``python -m memmagic run --gpu CARD ... script.py args`` in a
   subprocess, its report read from ``--json``;
2. in a notebook: a real IPython shell (the ``ip`` fixture), the script as a
   ``%%gpumem --backend sim`` cell (its code, or ``%run script.py args`` in the cell), or as
   plain cells after ``%gpusim on``.

Each run has hand checks: the report's parameters, gradients, optimizer state (and what
the script leaves, where every tensor can be named) against arithmetic written out in the
comments, each tensor rounded to the CUDA caching allocator's 512-byte blocks (``rnd``).
Tiny models: each run takes seconds. Known defects are ``xfail(strict=True)`` with the
defect in one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from memmagic.backends.sim.cudnn import rnn_workspace

SCRIPTS = Path(__file__).resolve().parent / "scripts"
CUBLAS = 8519680  # one cuBLAS workspace on a T4 or an A100 (2 x 4 MiB + 8 x 16 KiB), per thread
CUBLAS_H100 = 32 << 20  # on an H100, per thread
CUBLASLT = 1 << 20  # the cuBLASLt workspace of a Linear with a bias (addmm), main thread


def rnd(n: int) -> int:
    """What the CUDA caching allocator hands out for an n-byte tensor (multiples of 512)."""
    return -(-n // 512) * 512


# -- the command line ----------------------------------------------------------------------------
@dataclass
class CliRun:
    rc: int
    out: str
    err: str
    report: dict | None
    cwd: Path

    @property
    def text(self) -> str:
        return self.out + self.err


def run_cli(cwd: Path, options: list[str], script: str, *args: str) -> CliRun:
    """``python -m memmagic run OPTIONS --json r.json scripts/SCRIPT ARGS`` in ``cwd``."""
    out = cwd / "memmagic-report.json"
    proc = subprocess.run([sys.executable, "-m", "memmagic", "run", *options, "--json", str(out),
                           str(SCRIPTS / script), *args],
                          capture_output=True, text=True, cwd=cwd, timeout=300)
    report = json.loads(out.read_text()) if out.exists() else None
    return CliRun(proc.returncode, proc.stdout, proc.stderr, report, cwd)


def clean_dir(factory, name: str) -> Path:
    """An empty folder the script runs in: what it leaves there is what it wrote to disk."""
    return factory.mktemp(name)


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ==============================================================================================
# 1. nanoGPT's train.py: configurator, estimate_loss, GradScaler + fp16, ckpt.pt saved and read
# ==============================================================================================
NANOGPT = "nanogpt_train.py"
NANOGPT_ARGS = ("--max_iters=4", "--compile=False")
# vocab 512, block 64, 2 layers of width 64, no biases; wte and lm_head are one tensor (tied):
# wte 512 x 64 and wpe 64 x 64 fp32; per block ln_1 (64), c_attn 192 x 64, c_proj 64 x 64,
# ln_2 (64), c_fc 256 x 64, mlp c_proj 64 x 256 (a 64-value norm is 256 B: one 512-byte block);
# ln_f. 15 tensors, 543,232 B
NANOGPT_TENSORS = ([512 * 64, 64 * 64]
                   + 2 * [64, 192 * 64, 64 * 64, 64, 256 * 64, 64 * 256]
                   + [64])
NANOGPT_PARAMS = sum(rnd(n * 4) for n in NANOGPT_TENSORS)
# fused AdamW (the script asks for it on CUDA): exp_avg and exp_avg_sq of each parameter, and
# each parameter's step counter on the GPU (a 1-value fp32 tensor: one 512-byte block)
NANOGPT_OPT = 2 * NANOGPT_PARAMS + len(NANOGPT_TENSORS) * 512
# what the script leaves: parameters and AdamW's state (zero_grad(set_to_none) dropped the
# gradients); the two cuBLAS workspaces (main and autograd thread; no Linear has a bias, so no
# cuBLASLt one); `logits` of the last micro-step, fp16 under autocast: 8 x 64 x 512 x 2 B;
# the next batch X, Y fetched in the loop (8 x 64 int64 each); and three 0-d tensors: `loss`,
# the GradScaler's scale (fp32) and growth tracker (int32)
NANOGPT_AFTER = (NANOGPT_PARAMS + NANOGPT_OPT + 2 * CUBLAS + 8 * 64 * 512 * 2
                 + 2 * rnd(8 * 64 * 8) + 3 * 512)                          # 19,210,752 B


def check_nanogpt(breakdown: dict, peak: int, after: int) -> None:
    assert NANOGPT_PARAMS == 543232
    assert breakdown["parameters"] == NANOGPT_PARAMS
    # the peak is in the backward of the second micro-step (gradient accumulation 2) of an
    # iteration after the first: the first micro-step's gradients are held, one per parameter,
    # and AdamW's state exists
    assert breakdown["gradients"] == NANOGPT_PARAMS
    assert breakdown["optimizer_state"] == NANOGPT_OPT                      # 1,094,144 B
    assert after == NANOGPT_AFTER
    # at the cross entropy's backward: the log-softmax output it saved, fp32 (8 x 64 tokens x
    # 512 = 1 MiB), and beside it the gradient it makes (1 MiB) and the fp16 logits (512 KiB)
    logits = 8 * 64 * 512
    assert breakdown["activations"] >= logits * 4
    assert breakdown["other"] >= logits * 4 + logits * 2
    assert peak >= (2 * NANOGPT_PARAMS + NANOGPT_OPT + 2 * CUBLAS + logits * (4 + 4 + 2))


@pytest.fixture(scope="module")
def nanogpt_cli(tmp_path_factory) -> CliRun:
    cwd = clean_dir(tmp_path_factory, "nanogpt")
    return run_cli(cwd, ["--gpu", "T4"], NANOGPT, *NANOGPT_ARGS)


def test_nanogpt_train_py_on_the_command_line(nanogpt_cli):
    run = nanogpt_cli
    assert run.rc == 0, run.text
    assert "setting max_iters = 4" in run.out and "setting compile = False" in run.out
    check_nanogpt(run.report["breakdown"], run.report["peak"], run.report["after"])
    # the script made out-tiny/ and wrote ckpt.pt twice, then read it back: all of it on the
    # scratch disk; the real folder holds only what the test put there
    assert listing(run.cwd) == ["memmagic-report.json"]
    assert "note: the script made out-tiny" in run.out and "nothing on disk was changed" in run.out
    assert "resumed from iteration 4" in run.out
    assert "note: torch.save skipped 2 times ('out-tiny/ckpt.pt', 'out-tiny/ckpt.pt')" in run.out
    assert "note: torch.load('out-tiny/ckpt.pt') gave simulated tensors" in run.out
    # the training loss: `loss.item() * gradient_accumulation_steps` printed with :.4f
    iters = [ln for ln in run.out.splitlines() if ln.startswith("iter ")]
    assert len(iters) == 5  # iterations 0..4 (the loop ends after max_iters)
    assert all(re.match(r"iter \d: loss 2\.0000\(simulated\), time ", ln) for ln in iters), iters


def test_nanogpt_estimate_loss_lines_say_their_numbers_are_simulated(nanogpt_cli):
    """estimate_loss() keeps each batch's `loss.item()` in `losses[k]` of a CPU tensor and
    returns `losses.mean()`: the numbers the script prints come from placeholders, so they
    must be marked as the training loss is."""
    lines = [ln for ln in nanogpt_cli.out.splitlines() if ln.startswith("step ")]
    assert len(lines) == 3  # evaluations at iterations 0, 2 and 4
    for line in lines:
        assert re.fullmatch(r"step \d: train loss 1\.0000\(simulated\), "
                            r"val loss 1\.0000\(simulated\)", line), line


def test_nanogpt_sampling_evaluates_the_growing_calls_as_running_them_would(tmp_path_factory):
    """After training, ``--sample_tokens=120`` samples as nanoGPT's sample.py does: each call
    of the model takes all the tokens so far (cropped to the 64-token block). The calls that
    grow are read off a curve, the ones past the block repeat each other: the report is the
    one of running every call (``--decode-steps run``). (Memory-efficient attention pads its
    logsumexp to 32 positions: a size that steps where the curve cannot see it, which the
    check after it finds, and the note says.)"""
    args = (*NANOGPT_ARGS, "--sample_tokens=120", "--eval_iters=1")
    fast, slow = (run_cli(clean_dir(tmp_path_factory, f"sample-{m}"),
                          ["--gpu", "T4", "--decode-steps", m], NANOGPT, *args)
                  for m in ("evaluate", "run"))
    assert fast.rc == slow.rc == 0, fast.text + slow.text
    assert "sampled 120 tokens" in fast.out
    for key in ("peak", "reserved_peak", "after", "breakdown", "peak_module", "peak_op",
                "host_peak"):
        assert fast.report[key] == slow.report[key], key
    note = next(n for n in fast.report["notes"] if "whose sizes grew at each call" in n)
    assert "(GPT) whose sizes grew" in note and "ran op by op as checks" in note, note
    assert "1 check did NOT do what the calls before did" in note, note


def test_nanogpt_train_py_in_a_gpumem_cell_with_run(ip, clean_state, tmp_path, monkeypatch,
                                                    capsys):
    """The script run by ``%run`` inside a ``%%gpumem --backend sim`` cell: the same numbers as
    from the command line."""
    monkeypatch.chdir(tmp_path)
    r = ip.run_cell_magic("gpumem", "--backend sim --gpu T4 -o -q --no-chart",
                          f"%run {SCRIPTS / NANOGPT} {' '.join(NANOGPT_ARGS)}")
    out = capsys.readouterr().out
    assert r.error is None, r.error
    assert "resumed from iteration 4" in out
    check_nanogpt(r.breakdown, r.peak, r.after)
    assert any("torch.save skipped 2 times" in n for n in r.notes)


# ==============================================================================================
# 2. build-nanogpt's train_gpt2.py: hard-coded B, T; {norm:.4f}; cosine LR; bf16 autocast
# ==============================================================================================
BUILD = "build_nanogpt_train.py"
# vocab 1024, block 128, 2 layers of width 64 with biases (GPT-2's layout), wte tied to
# lm_head. Per block: ln_1 weight and bias (64 each: one block each), c_attn 192 x 64 and its
# bias (192 x 4 = 768 B -> 1,024), c_proj 64 x 64 and bias, ln_2, c_fc 256 x 64 and bias
# (1,024 B), mlp c_proj 64 x 256 and bias. 28 tensors (10 decay, 18 do not), 699,392 B
BUILD_TENSORS = ([1024 * 64, 128 * 64]
                 + 2 * [64, 64, 192 * 64, 192, 64 * 64, 64, 64, 64, 256 * 64, 256, 64 * 256, 64]
                 + [64, 64])
BUILD_PARAMS = sum(rnd(n * 4) for n in BUILD_TENSORS)
# fused AdamW over the two weight-decay groups: two moments per parameter and each one's step
# counter on the GPU (one block each)
BUILD_OPT = 2 * BUILD_PARAMS + len(BUILD_TENSORS) * 512
BF16_LOGITS = 8 * 128 * 1024 * 2  # B x T x vocab in bf16: 2 MiB


def check_build_nanogpt(breakdown: dict) -> None:
    assert BUILD_PARAMS == 699392 and BUILD_OPT == 1413120
    assert breakdown["parameters"] == BUILD_PARAMS
    # the peak is in the cross entropy's backward of the second micro-step: the first
    # micro-step's gradients are held (accumulated), and AdamW's state from step 1 on
    assert breakdown["gradients"] == BUILD_PARAMS
    assert breakdown["optimizer_state"] == BUILD_OPT
    # the log-softmax output the backward reads, fp32 (autocast computes the loss in fp32):
    # 8 x 128 x 1024 x 4 B = 4 MiB; beside it the gradient it makes (4 MiB) and the bf16 logits
    # the name `logits` holds (2 MiB)
    assert breakdown["activations"] >= 2 * BF16_LOGITS
    assert breakdown["other"] >= 2 * BF16_LOGITS + BF16_LOGITS
    assert breakdown["workspaces"] == 2 * CUBLAS + CUBLASLT


def build_nanogpt_after() -> int:
    """What the loop leaves at the end of an iteration (zero_grad is at the top of the next):
    parameters, their gradients, AdamW's state; the workspaces; the bf16 `logits` of the last
    micro-step; `x`, `y` (8 x 128 int64 each); three 0-d fp32 tensors: `loss`, `loss_accum`
    (0.0 + the first detached loss makes it a tensor) and `norm`."""
    return (2 * BUILD_PARAMS + BUILD_OPT + 2 * CUBLAS + CUBLASLT + BF16_LOGITS
            + 2 * rnd(8 * 128 * 8) + 3 * 512)                             # 23,014,912 B


def test_build_nanogpt_loop_cut_by_steps_on_the_command_line(tmp_path):
    run = run_cli(tmp_path, ["--gpu", "A100-40GB", "--steps", "3"], BUILD)
    assert run.rc == 0, run.text
    assert "note: stopped after 3 optimizer step(s) (--steps 3)" in run.out
    assert "using device: cuda" in run.out and "using fused AdamW: True" in run.out
    assert "=> calculated gradient accumulation steps: 2" in run.out  # 2048 / (8 x 128)
    check_build_nanogpt(run.report["breakdown"])
    assert run.report["after"] == build_nanogpt_after()  # cut at the 3rd optimizer.step()
    # the log line of steps 0 and 1 (the run is cut inside step 2's optimizer.step()): the
    # loss and the gradient norm are placeholders, marked; the learning rate is computed from
    # the step alone (warmup: 6e-4 x (step + 1) / 5), a real number
    logs = [ln for ln in run.out.splitlines() if ln.startswith("step ")]
    assert [ln.split(" | ")[:4] for ln in logs] == [
        ["step     0", "loss: 1.000000(simulated)", "lr 1.2000e-04", "norm: 1.0000(simulated)"],
        ["step     1", "loss: 1.000000(simulated)", "lr 2.4000e-04", "norm: 1.0000(simulated)"]]


def test_build_nanogpt_as_a_plain_cell_under_gpusim(ip, clean_state, capsys):
    """``%gpusim on`` and the script's code as a plain cell: all 20 steps on the simulated
    A100; a ``%%gpumem`` cell after it sees what the loop left on the notebook's GPU."""
    ip.run_line_magic("gpusim", "on --gpu A100-40GB")
    result = ip.run_cell((SCRIPTS / BUILD).read_text())
    out = capsys.readouterr().out
    assert result.error_in_exec is None, result.error_in_exec
    assert "using device: cuda" in out and out.count("| norm: 1.0000(simulated) |") == 20
    nxt = ip.run_cell_magic("gpumem", "-o -q --no-chart", "pass")
    left = nxt.breakdown_before
    assert left["parameters"] == BUILD_PARAMS and left["gradients"] == BUILD_PARAMS
    assert left["optimizer_state"] == BUILD_OPT
    assert nxt.before == build_nanogpt_after()
    ip.run_line_magic("gpusim", "off")


def test_build_nanogpt_by_run_under_gpusim(ip, clean_state, tmp_path, monkeypatch, capsys):
    """``%gpusim on`` then ``%run train.py``: how a notebook runs a script file. Expected as a
    plain cell of its code: on the simulated GPU."""
    monkeypatch.chdir(tmp_path)
    ip.run_line_magic("gpusim", "on --gpu A100-40GB")
    ip.run_cell(f"%run {SCRIPTS / BUILD}")
    out = capsys.readouterr().out
    nxt = ip.run_cell_magic("gpumem", "-o -q --no-chart", "pass")
    ip.run_line_magic("gpusim", "off")
    assert "using device: cuda" in out, out[:200]
    assert nxt.breakdown_before["parameters"] == BUILD_PARAMS


# ==============================================================================================
# 3. word_language_model: LSTM, repackage_hidden, clip_grad_norm_, p.data.add_(p.grad, -lr)
# ==============================================================================================
WORD_LM = "word_lm_lstm.py"
WORD_LM_ARGS = ("--cuda", "--epochs", "1")
# vocabulary 1,000 (999 words and <eos>), embeddings 128, 2 LSTM layers of 256, fp32:
# encoder 1000 x 128; layer 0: w_ih 1024 x 128, w_hh 1024 x 256, b_ih and b_hh 1024 each;
# layer 1: w_ih and w_hh 1024 x 256, two biases; decoder 1000 x 256 and its bias (4,000 B ->
# 4,096). (Every LSTM tensor is a whole number of 512-byte blocks: cuDNN's one flat weight
# buffer, which flatten_parameters() makes on a GPU, is then exactly as large.)
WORD_LM_TENSORS = [1000 * 128,
                   1024 * 128, 1024 * 256, 1024, 1024,
                   1024 * 256, 1024 * 256, 1024, 1024,
                   1000 * 256, 1000]
WORD_LM_PARAMS = sum(rnd(n * 4) for n in WORD_LM_TENSORS)
# the corpus: 200 training lines of 10 words and <eos> = 2,200 ids in 16 columns (137 rows, 8
# dropped), 40 validation lines = 440 ids in 10 columns (44 rows), int64 on the GPU
WORD_LM_DATA = rnd(137 * 16 * 8) + rnd(44 * 10 * 8)                         # 17,920 + 3,584 B


def check_word_lm(breakdown: dict, peak: int, after: int) -> None:
    assert WORD_LM_PARAMS == 5226496
    assert breakdown["parameters"] == WORD_LM_PARAMS
    # the peak is at the start of the LSTM's backward, where cuDNN takes its workspace:
    # model.zero_grad() set every gradient to None before the batch and none is made yet; no
    # optimizer, no state
    assert breakdown["gradients"] == 0 and breakdown["optimizer_state"] == 0
    # the log-softmax output saved for the loss's backward, 32 steps x 16 columns x 1,000 words
    # fp32 = 2,048,000 B, and the gradient its backward made, as large
    saved = 32 * 16 * 1000 * 4
    assert breakdown["activations"] >= saved and breakdown["other"] >= saved
    # cuBLAS's two and cuBLASLt's (the decoder has a bias: addmm), and cuDNN's RNN workspace
    # for 2 layers of 256 over 32 steps x 16 columns (scaled from the nearest shape measured)
    rnn = rnn_workspace("LSTM", torch.float32, 2, False, 32, 16, 256, 256)[0]
    assert breakdown["workspaces"] == 2 * CUBLAS + CUBLASLT + rnn
    assert peak >= WORD_LM_PARAMS + 2 * CUBLAS + CUBLASLT + rnn + WORD_LM_DATA + saved
    # what the script leaves: the parameters and the last batch's gradients (the hand-written
    # SGD update keeps them; the next batch's zero_grad would drop them), the workspaces and
    # the id tensors of the two splits; the evaluation's hidden state was local to it
    assert after == 2 * WORD_LM_PARAMS + 2 * CUBLAS + CUBLASLT + WORD_LM_DATA  # 28,562,432 B


@pytest.fixture(scope="module")
def word_lm_cli(tmp_path_factory) -> CliRun:
    return run_cli(clean_dir(tmp_path_factory, "word_lm"), ["--gpu", "T4"], WORD_LM, *WORD_LM_ARGS)


def test_word_language_model_on_the_command_line(word_lm_cli):
    run = word_lm_cli
    assert run.rc == 0, run.text
    check_word_lm(run.report["breakdown"], run.report["peak"], run.report["after"])
    # batches 0..4 of one epoch (137 rows, bptt 32); logged at batches 2 and 4: the mean of
    # two placeholder losses, marked
    # (batches 0-2, then 3-4)
    logs = [ln for ln in run.out.splitlines() if ln.startswith("| epoch ")]
    assert len(logs) == 2, logs
    assert "|     2/    4 batches |" in logs[0] and "| loss  1.50(simulated) |" in logs[0]
    assert "|     4/    4 batches |" in logs[1] and "| loss  1.00(simulated) |" in logs[1]
    assert "valid loss  1.00(simulated)" in run.out
    # torch.save(model, f) wrote model.pt on the scratch disk only
    assert listing(run.cwd) == ["memmagic-report.json"]
    assert "note: the script wrote model.pt" in run.out


def test_word_language_model_by_run_in_a_gpumem_cell(ip, clean_state, tmp_path, monkeypatch):
    """``%run`` in a ``%%gpumem --backend sim`` cell; a second sim cell (the notebook's one
    simulated GPU) sees the gradients the loop left, per category."""
    monkeypatch.chdir(tmp_path)
    r = ip.run_cell_magic("gpumem", "--backend sim --gpu T4 -o -q --no-chart",
                          f"%run {SCRIPTS / WORD_LM} {' '.join(WORD_LM_ARGS)}")
    assert r.error is None, r.error
    check_word_lm(r.breakdown, r.peak, r.after)
    nxt = ip.run_cell_magic("gpumem", "--backend sim --gpu T4 -o -q --no-chart", "pass")
    left = nxt.breakdown_before
    # the gradients, one per parameter, each as large as its parameter
    assert left["parameters"] == left["gradients"] == WORD_LM_PARAMS
    assert left["other"] == WORD_LM_DATA and left["activations"] == 0


def test_word_language_model_in_a_notebook_leaves_an_existing_checkpoint_alone(ip, clean_state,
                                                                            tmp_path,
                                                                            monkeypatch):
    """A notebook folder that holds a trained model.pt: the simulated run's `with
    open(args.save, "wb") as f: torch.save(model, f)` must not destroy it (the command line
    runs the script over a scratch disk; a simulated save writes nothing)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.pt").write_bytes(b"weights of a real training run")
    r = ip.run_cell_magic("gpumem", "--backend sim --gpu T4 -o -q --no-chart",
                          f"%run {SCRIPTS / WORD_LM} {' '.join(WORD_LM_ARGS)}")
    assert r.error is None, r.error
    assert any("torch.save('model.pt') skipped" in n and "nothing was written" in n
               for n in r.notes)
    assert (tmp_path / "model.pt").read_bytes() == b"weights of a real training run"


# ==============================================================================================
# 4. FSDP2 on the meta device over 2 ranks (torchrun's environment)
# ==============================================================================================
FSDP = "fsdp2_meta_init.py"
# full model: token embeddings 1024 x 256, positions 128 x 256, per block two LayerNorms
# (weight and bias of 256), wq wk wv wo 256 x 256, w1 1024 x 256, w2 256 x 1024; the final
# LayerNorm; output 1024 x 256: 2,132,480 values. fully_shard splits each tensor's first
# dimension over the 2 GPUs: rank 0 holds the first half of every tensor, each its own
# allocation (a LayerNorm's 128 fp32 = 512 B, one block)
FSDP_ROOT = [1024 * 256, 128 * 256, 256, 256, 1024 * 256]  # the root's own tensors
FSDP_BLOCK = [256, 256, 256, 256] + 4 * [256 * 256] + [1024 * 256, 256 * 1024]
FSDP_SHARDED = (sum(rnd(n // 2 * 4) for n in FSDP_ROOT)
                + 2 * sum(rnd(n // 2 * 4) for n in FSDP_BLOCK))           # 4,264,960 B


def check_fsdp(breakdown: dict) -> None:
    assert FSDP_SHARDED == (sum(FSDP_ROOT) + 2 * sum(FSDP_BLOCK)) // 2 * 4 == 4264960
    # AdamW (foreach, step counters on the host): two moments of each local shard, half of
    # the full model's 2 x 8,529,920 B
    assert breakdown["optimizer_state"] == 2 * FSDP_SHARDED
    # the peak is in the second step's backward of block 1 (its w2): the parameters are the
    # shards, plus the unsharded tensors of the root (FSDP2 keeps the root's gathered after
    # the forward, the backward needs them first) and of block 1 (gathered again for its
    # backward); block 0 is not gathered yet
    root_full = sum(FSDP_ROOT) * 4                                         # 2,230,272 B
    block_full = sum(FSDP_BLOCK) * 4                                       # 3,149,824 B
    assert breakdown["parameters"] == FSDP_SHARDED + root_full + block_full
    assert breakdown["workspaces"] == 2 * CUBLAS_H100  # no Linear with a bias: no cuBLASLt


def test_fsdp2_meta_device_recipe_as_a_gpumem_cell_over_two_ranks(ip, clean_state, monkeypatch,
                                                                  capsys):
    import torch.distributed as dist

    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    monkeypatch.setattr(sys, "argv", [str(SCRIPTS / FSDP)])  # as `%run` or torchrun sets it
    r = ip.run_cell_magic("gpumem", "--backend sim --gpu H100 --world-size 2 -o -q --no-chart",
                          (SCRIPTS / FSDP).read_text())
    out = capsys.readouterr().out
    assert r.error is None, r.error
    # the script's own count: half of the 2,132,480 values on rank 0 of 2
    assert "rank 0/2: 1,066,240 parameters held here of 2,132,480" in out
    assert "step 1: loss 1.0000(simulated)" in out
    check_fsdp(r.breakdown)
    assert any("rank 0 of 2 GPUs" in n for n in r.notes)
    # torchrun's environment and the process group were the cell's only
    assert {k: os.environ.get(k) for k in env} == env and not dist.is_initialized()


def test_fsdp2_script_as_every_rank_on_the_command_line(tmp_path_factory):
    """Rank 1 calls set_device(1) and materialises its shards on cuda:1 (FSDP2 checks that
    each parameter is on the rank's device): it runs as rank 0 does, with the other half of
    every tensor, which is as large."""
    run = run_cli(clean_dir(tmp_path_factory, "fsdp-ranks"),
                  ["--gpu", "H100", "--world-size", "2", "--ranks", "all"], FSDP)
    assert run.rc == 0, run.text
    assert "memmagic: rank 1 of 2: peak" in run.err  # the script reports on rank 0 only
    assert re.search(r"  ranks 0-1 +peak [0-9.]+ MiB, reserved [0-9.]+ MiB: fits", run.out), run.out
    assert run.report["deciding_rank"] == 0
    assert run.report["ranks"]["0"] == run.report["ranks"]["1"]
    check_fsdp(run.report["breakdown"])


def test_fsdp2_script_refuses_a_node_with_fewer_gpus_than_the_job(ip, clean_state, monkeypatch,
                                                                  capsys):
    """Without --world-size the simulated node has one GPU: a script started as rank 0 of 2
    says so and exits, as on a one-GPU machine."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPTS / FSDP)])
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exc:
        ip.run_cell_magic("gpumem", "--backend sim --gpu H100 -o -q --no-chart",
                          (SCRIPTS / FSDP).read_text())
    assert exc.value.code == 1
    assert "this job needs 2 GPUs on the node, it has 1" in capsys.readouterr().err


def test_fsdp2_meta_device_recipe_on_the_command_line(tmp_path):
    run = run_cli(tmp_path, ["--gpu", "H100", "--world-size", "2"], FSDP)
    assert run.rc == 0, run.text
    assert "rank 0/2: 1,066,240 parameters held here of 2,132,480" in run.out
    check_fsdp(run.report["breakdown"])
    assert "rank 0 of 2 GPUs" in run.report["device"] or any(
        "rank 0 of 2 GPUs" in n for n in run.report["notes"])


# ==============================================================================================
# 5. QLoRA with transformers.Trainer: 4-bit NF4 base, prepare_model_for_kbit_training, LoRA
# ==============================================================================================
QLORA = "qlora_trainer.py"
_WORDS = ["<unk>", "<s>", "</s>", "###", "Question", "Answer", ":"]


def save_tiny_llama(path: Path) -> None:
    """A 2-layer Llama (d 256, ffn 512, 4 heads, vocab 512, untied) and a word-level
    tokenizer, saved as from_pretrained reads them: nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = _WORDS + [f"w{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}"
                      for i in range(512 - len(_WORDS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                 bos_token_id=1, eos_token_id=2,
                                 tie_word_embeddings=False)).save_pretrained(path)


def _qstate(n: int) -> int:
    """The quantization state bitsandbytes keeps beside an NF4 weight of n values with double
    quantization (blocks of 64, their absmax quantized in blocks of 256): absmax uint8 n/64,
    the nested absmax fp32 per 256 blocks, the NF4 code (16 fp32), the offset (one fp32) and
    the nested state's 8-bit code (256 fp32), each its own 512-byte block."""
    return rnd(n // 64) + rnd(-(-n // 64 // 256) * 4) + rnd(16 * 4) + rnd(4) + rnd(256 * 4)


# per layer: q k v o (256 x 256 = 65,536 values) and gate up down (512 x 256 = 131,072) in NF4,
# two values a byte, with their quantization state
QLORA_PACKED = 2 * (4 * rnd(65536 // 2) + 3 * rnd(131072 // 2))            # 655,360 B
QLORA_QSTATE = 2 * (4 * _qstate(65536) + 3 * _qstate(131072))              # 56,320 B
# embeddings and lm_head (512 x 256) and five RMSNorm weights (256) stay fp32 (kbit prep)
QLORA_PLAIN = 2 * rnd(512 * 256 * 4) + 5 * rnd(256 * 4)                     # 1,053,696 B
QLORA_FROZEN = QLORA_PACKED + QLORA_QSTATE + QLORA_PLAIN                    # 1,765,376 B
# LoRA r=8 on q k v o of 2 layers: A 8 x 256 and B 256 x 8, fp32: 8,192 B each
QLORA_TRAINABLE = 2 * 4 * 2 * rnd(8 * 256 * 4)                             # 131,072 B
# paged_adamw_8bit: a tensor under 4,096 values keeps two fp32 moments (not 8-bit), and one
# under 100,000 values is not paged: the adapters' moments are ordinary CUDA memory
QLORA_OPT = 2 * QLORA_TRAINABLE
BUG_WARNING = "almost definitely a bug in your code"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path)
    return path


@pytest.mark.slow  # transformers, peft and bitsandbytes imported in a fresh process
def test_qlora_trainer_script_on_the_command_line(tiny_llama, tmp_path):
    run = run_cli(tmp_path, ["--gpu", "T4"], QLORA, "--model_name_or_path", str(tiny_llama))
    assert run.rc == 0, run.text
    assert BUG_WARNING not in run.text
    assert "training done" in run.out
    # peft's own count: 2 layers x 4 projections x (8 x 256 + 256 x 8) = 32,768 trainable
    assert "trainable params: 32,768 ||" in run.out
    report = run.report
    assert report["breakdown"]["parameters"] == QLORA_FROZEN + QLORA_TRAINABLE
    assert "(trainable 128.00 KiB, frozen 1.68 MiB)" in run.out
    # left: parameters, the rotary embedding's buffers, the cuBLAS workspaces (no Linear with
    # a bias), the adapters' two moments, and a few 0-d tensors (the GradScaler's scale and
    # growth tracker, the Trainer's running loss, ...)
    base = (QLORA_FROZEN + QLORA_TRAINABLE + report["breakdown"]["buffers"] + 2 * CUBLAS
            + QLORA_OPT)
    assert 0 <= report["after"] - base <= 8 * 512, report["after"] - base
    assert listing(run.cwd) == ["memmagic-report.json"]  # Trainer's output_dir: scratch only


def test_qlora_trainer_script_as_a_gpumem_cell(ip, clean_state, tiny_llama, tmp_path, monkeypatch,
                                               capfd):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv",
                        [str(SCRIPTS / QLORA), "--model_name_or_path", str(tiny_llama)])
    r = ip.run_cell_magic("gpumem", "--backend sim --gpu T4 -o -q --no-chart",
                          (SCRIPTS / QLORA).read_text())
    captured = capfd.readouterr()
    assert r.error is None, r.error
    assert BUG_WARNING not in captured.out + captured.err
    assert r.frozen_parameters == QLORA_FROZEN
    assert r.breakdown["parameters"] - r.frozen_parameters == QLORA_TRAINABLE
    assert any("bitsandbytes kernels ran" in n for n in r.notes)
    # the optimizer's state, read as the notebook's simulated GPU holds it after the cell
    nxt = ip.run_cell_magic("gpumem", "--backend sim --gpu T4 -o -q --no-chart", "pass")
    assert nxt.breakdown_before["optimizer_state"] == QLORA_OPT
    assert nxt.breakdown_before["gradients"] == 0  # Trainer zeroes them after each step


# ==============================================================================================
# 6. A LoRA loop on a Llama built from its config in bf16: out of memory, the doctor's ranking
# ==============================================================================================
LORA = "lora_llama_8b.py"
# a small Llama of the same shape: 4 layers of width 512, GQA 8/4 heads, vocab 32000
LORA_SMALL = ("--layers", "4", "--hidden", "512", "--ffn", "1376", "--heads", "8",
              "--kv_heads", "4", "--vocab", "32000")


def test_lora_loop_out_of_memory_gets_the_one_fix_that_fits(tmp_path):
    """Batch 4 x 2048 on 768 MiB runs out of memory in the forward. Every fix the doctor
    tries first runs out too, at different places (each row says where); the context the
    runs for the line through them reach, 256, fits, and the line says the next does not:
    that row is the one fix that fits. (The combination search a table of no fitting row
    gets: tests/doctor/test_doctor.py.)"""
    run = run_cli(tmp_path, ["--gpu-memory", "768MiB", "--steps", "2"], LORA,
                  "--batch_size", "4", "--seq_len", "2048", *LORA_SMALL)
    assert run.rc == 1 and "memmagic: out of memory on simulated cuda:0" in run.err, run.text
    table = run.out.split("strategies, by peak (re-run with each):\n", 1)[1]
    rows = [ln for ln in table.splitlines() if ln.startswith("  ")]
    assert rows[0].startswith("  as written ") and "during forward, in `model." in rows[0]
    out_of_memory = [ln for ln in rows if "does not fit (out of memory asking for" in ln]
    assert len(out_of_memory) >= 5 and all(" during " in ln for ln in out_of_memory)
    fitting = [ln for ln in rows if ln.rstrip().endswith(" fits")]
    assert [ln.split("  ")[1] for ln in fitting] == \
        ["context 256 (from 2048), the longest that fits"], rows
    # its trainable parameters: LoRA r=16 on q k v o of 4 layers, fp32 A and B
    lora = 4 * 16 * ((512 + 512) + (512 + 256) + (512 + 256) + (512 + 512))
    assert f"trainable params: {lora:,}" in run.out


def test_the_scripts_say_what_they_imitate_and_how_to_run_them():
    scripts = sorted(SCRIPTS.glob("*.py"))
    assert {NANOGPT, BUILD, WORD_LM, FSDP, QLORA, LORA} <= {p.name for p in scripts}
    for path in scripts:  # the public style it imitates, what it exercises, its command line
        doc = path.read_text().split('"""')[1]
        assert "style of" in doc and "Run:" in doc, path.name
