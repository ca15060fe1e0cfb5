"""Fidelity of the simulated device.

(a) With CPU kernels and defaults (``kernels="cpu"``) the simulation reproduces the real
    CPU backend's peak to the byte on the zoo, fp32 and AMP, checkpointing on and off.
(b) With CUDA behaviour the figures differ where CUDA's kernels and defaults use memory
    differently; each difference is pinned by a test that shows why.
"""

from __future__ import annotations

import gc

import pytest
import torch

from memmagic import zoo
from memmagic.backends import get_backend
from memmagic.backends.sim import SimBackend

from conftest import skip_without_bf16_lstm


def _run(backend, src: str):
    gc.collect()  # tensors of earlier tests freed mid-run would lower the CPU backend's peak
    code = compile(src, "<cell>", "exec")
    out = backend.execute(lambda ns: exec(code, ns), {})
    assert out.error is None, out.error
    return out.report


# -- (a) ----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
@pytest.mark.parametrize("name", zoo.SMALL)
def test_cpu_kernels_match_real_cpu_to_the_byte(name, amp, checkpointing):
    skip_without_bf16_lstm(name == "lstm" and amp)
    real = _run(get_backend("cpu"), zoo.step_source(name, device="cpu", amp=amp,
                                                     checkpointing=checkpointing))
    sim = _run(SimBackend(kernels="cpu"), zoo.step_source(name, device="cuda", amp=amp,
                                                         checkpointing=checkpointing))
    assert sim.increment == real.increment
    assert sim.retained == real.retained
    assert sim.peak_op == real.peak_op


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
def test_cpu_kernels_match_real_cpu_on_bench_lstm_with_amp(checkpointing):
    skip_without_bf16_lstm()
    # the bf16 oneDNN LSTM workspace at a shape the "test" size does not reach (it read
    # 19-25% high when the fp32 formula stood in for it)
    real = _run(get_backend("cpu"), zoo.step_source("lstm", device="cpu", amp=True,
                                                     checkpointing=checkpointing, size="bench"))
    sim = _run(SimBackend(kernels="cpu"), zoo.step_source("lstm", device="cuda", amp=True,
                                                         checkpointing=checkpointing, size="bench"))
    assert sim.increment == real.increment
    assert sim.retained == real.retained


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lstm_workspace_formula_matches_onednn(dtype):
    skip_without_bf16_lstm(dtype == torch.bfloat16)
    from torch.utils._python_dispatch import TorchDispatchMode

    from memmagic.backends.sim.kernels import mkldnn_rnn_workspace

    layer = torch.ops.aten.mkldnn_rnn_layer.default
    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is layer:
                calls.append((out[3].numel(), mkldnn_rnn_workspace(args, kwargs or {})))
            return out

    # (T, B, I, H): odd sizes, leading dimensions at multiples of 256, the bench LSTM
    for T, B, I, H in [(7, 3, 5, 9), (33, 5, 100, 200), (64, 32, 256, 512), (12, 16, 512, 256),
                       (64, 128, 512, 512)]:
        lstm = torch.nn.LSTM(I, H)
        x = torch.randn(T, B, I, requires_grad=True)
        with Record(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32):
            lstm(x)
    assert len(calls) == 5
    for real, formula in calls:
        assert formula == real


# -- (b) ----------------------------------------------------------------------------------------
def _peak(src: str, kernels: str) -> int:
    return _run(SimBackend(kernels=kernels), src).increment


def _saved_bytes(src: str, kernels: str) -> int:
    r = _run(SimBackend(kernels=kernels), src)
    return r.breakdown["activations"]


def test_dropout_keeps_a_bool_mask_on_cuda():
    # CPU composite dropout saves a mask in the input dtype (4 B/elem); CUDA's fused
    # native_dropout saves a bool mask (1 B/elem).
    src = ("import torch\nx = torch.randn(1024, 1024, device='cuda', requires_grad=True)\n"
           "y = torch.nn.functional.dropout(x, 0.5)\n")
    cpu, cuda = _saved_bytes(src, "cpu"), _saved_bytes(src, "cuda")
    assert cpu == 4 << 20 and cuda == 1 << 20


def test_sdpa_with_dropout_saves_no_LxL_matrix_on_cuda():
    # on the CPU, SDPA with dropout takes the math path and saves B*H*L*L attention
    # weights and a mask; CUDA's flash / memory-efficient kernels save a B*H*L logsumexp.
    src = ("import torch\nq = torch.randn(2, 4, 1024, 64, device='cuda', requires_grad=True)\n"
           "y = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)\n")
    cpu, cuda = _saved_bytes(src, "cpu"), _saved_bytes(src, "cuda")
    lxl = 2 * 4 * 1024 * 1024 * 4
    assert cpu > lxl
    qkv, lse = 2 * 4 * 1024 * 64 * 4, 2 * 4 * 1024 * 4
    assert cuda == 2 * qkv + lse  # q (saved once for q, k, v) + output + fp32 logsumexp
    report = _run(SimBackend(), src)
    assert any("efficient 1x" in n for n in report.notes)  # fp32: memory-efficient kernel


def test_sdpa_picks_flash_for_half_on_ampere_and_efficient_on_turing():
    src = ("import torch\nq = torch.randn(2, 4, 256, 64, device='cuda', dtype=torch.float16, requires_grad=True)\n"
           "torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()\n")
    assert any("flash 1x" in n for n in _run(SimBackend(gpu="A100"), src).notes)
    assert any("efficient 1x" in n for n in _run(SimBackend(gpu="T4"), src).notes)


def test_foreach_optimizer_transient_on_cuda():
    # CUDA defaults to the foreach Adam, which holds about one extra parameter-sized
    # temporary per step; the CPU default (single tensor) holds one parameter at a time.
    src = ("import torch\nps = [torch.nn.Parameter(torch.randn(256, 1024, device='cuda')) for _ in range(8)]\n"
           "opt = torch.optim.Adam(ps)\nfor p in ps: p.grad = torch.ones_like(p)\nopt.step()\n")
    cpu = _run(SimBackend(kernels="cpu"), src)
    cuda = _run(SimBackend(kernels="cuda"), src)
    one = 256 * 1024 * 4
    assert cuda.increment - cpu.increment >= 4 * one
    assert cuda.peak_op.startswith("_foreach")


def test_cuda_autocast_keeps_softmax_and_layer_norm_in_fp32():
    seen: dict = {}

    class Rec:
        def __setitem__(self, k, v):
            seen[k] = v

        def __deepcopy__(self, memo):
            return self

    src = """
import torch
x = torch.randn(8, 64, device="cuda", requires_grad=True)
w = torch.randn(64, 64, device="cuda", requires_grad=True)
with torch.autocast("cuda"):
    h = x @ w
    rec["dtypes"] = (h.dtype, torch.softmax(h, -1).dtype,
                     torch.nn.functional.layer_norm(h, (64,)).dtype,
                     torch.log_softmax(h, -1).dtype, h.sum().dtype,
                     torch.einsum("ij,jk->ik", x, w).dtype)
"""
    code = compile(src, "<cell>", "exec")
    for kernels, expected in [("cuda", (torch.float16, torch.float32, torch.float32, torch.float32,
                                        torch.float32, torch.float16)),
                              ("cpu", (torch.bfloat16,) * 6)]:
        out = SimBackend(kernels=kernels).execute(lambda ns: exec(code, ns), {"rec": Rec()})
        assert out.error is None, out.error
        assert seen["dtypes"] == expected, kernels


def test_cuda_rounds_to_512_bytes():
    src = "import torch\nxs = [torch.empty(3, device='cuda') for _ in range(10)]\n"
    assert _peak(src, "cuda") == 10 * 512
    assert _peak(src, "cpu") == 10 * 12


def test_transformer_activations_smaller_on_cuda():
    # the notes: uncorrected, a transformer's simulated activations came out ~2x CUDA's
    src = zoo.step_source("transformer", device="cuda")
    cpu = _run(SimBackend(kernels="cpu"), src)
    cuda = _run(SimBackend(kernels="cuda"), src)
    assert cuda.breakdown["activations"] < 0.85 * cpu.breakdown["activations"]


# -- GPT-2 small ------------------------------------------------------------------------------
@pytest.mark.slow
def test_gpt2_small_amp_step_simulates():
    # a 124M-parameter AMP step (B=8, S=1024) simulates on a CPU-only machine. How fast is
    # measured in benchmarks/ (side by side with the other cases), never timed here.
    report = _run(SimBackend(), zoo.step_source("gpt2_small", device="cuda", amp=True))
    params = report.breakdown["parameters"]
    assert params > 4 * 124_000_000  # fp32 weights (the LM head is not tied)
    assert report.before == 0
    assert 6 << 30 < report.peak < 9 << 30  # the notes: 7.5 GiB
    assert report.peak <= report.reserved_peak < 1.25 * report.peak
    assert report.after >= 3 * params  # weights and AdamW's two moments stay


# -- the op cache changes speed, never a byte ---------------------------------------------------
def _facts(r):
    return (r.peak, r.before, r.after, r.reserved_peak, r.reserved_after, r.peak_op,
            r.peak_module, r.host_peak, dict(r.breakdown), r.timeline)


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["cuda", "cpu"])
@pytest.mark.parametrize("name", zoo.SMALL)
def test_op_cache_gives_the_same_report_cold_warm_and_off(name, kernels):
    from memmagic.backends.sim import backend as sim_backend_mod

    src = zoo.step_source(name, device="cuda", amp=True, checkpointing=name != "lstm")
    off = SimBackend(kernels=kernels, op_cache=False)
    on = SimBackend(kernels=kernels)
    saved = dict(sim_backend_mod._FAST_ENTRIES)
    sim_backend_mod._FAST_ENTRIES.clear()
    try:
        reference = _facts(_run(off, src))
        assert off.last_run_stats["cache_hits"] == 0
        cold = _facts(_run(on, src))
        cold_stats = on.last_run_stats
        warm = _facts(_run(on, src))
        warm_stats = on.last_run_stats
    finally:
        sim_backend_mod._FAST_ENTRIES.clear()
        sim_backend_mod._FAST_ENTRIES.update(saved)
    assert cold == reference
    assert warm == reference
    assert cold_stats["cache_misses"] > 0
    # the second run finds what the first stored: most ops are answered from metadata
    assert warm_stats["cache_misses"] == 0
    assert warm_stats["cache_hits"] > warm_stats["ops"] // 2
    # what the warm run still leaves to FakeTensorMode: ops on constants (whose values it
    # computes), and few others
    assert warm_stats["cache_passes"] <= warm_stats["ops"] // 5, warm_stats


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["cuda", "cpu"])
@pytest.mark.parametrize("name", zoo.SMALL)
def test_a_new_batch_size_derived_from_meta_kernels_gives_the_uncached_report(name, kernels):
    """After one run, a run at another batch size takes most of its new entries from the
    ops' Meta kernels (FakeOutputCache's trusted classes): the report is the one
    FakeTensorMode alone gives at that size, with AMP and checkpointing."""
    from memmagic.backends.sim import backend as sim_backend_mod

    def src(k: int) -> str:
        step = zoo.step_source(name, device="cuda", amp=True, checkpointing=name != "lstm")
        return step.replace("opt = ", f"batch = tuple(t[:{k}] for t in batch)\nopt = ", 1)

    on = SimBackend(kernels=kernels)
    saved = dict(sim_backend_mod._FAST_ENTRIES)
    sim_backend_mod._FAST_ENTRIES.clear()
    try:
        _run(on, src(3))
        derived = _facts(_run(on, src(2)))
        stats = on.last_run_stats
    finally:
        sim_backend_mod._FAST_ENTRIES.clear()
        sim_backend_mod._FAST_ENTRIES.update(saved)
    assert derived == _facts(_run(SimBackend(kernels=kernels, op_cache=False), src(2)))
    assert stats["cache_derived"] > 3 * stats["cache_misses"], stats


def test_an_adam_step_is_answered_from_metadata_when_warm():
    """Adam's first step writes data into small zero-filled moments (constants): the op
    cache keys such mixed ops by metadata, so a warm run leaves none of the optimizer's
    foreach ops to FakeTensorMode, and the report is the one the uncached run gives."""
    import memmagic.backends.sim.op_cache as oc

    src = zoo.step_source("transformer", device="cuda", amp=False, checkpointing=False)
    off = _facts(_run(SimBackend(op_cache=False), src))
    on = SimBackend()
    _run(on, src)
    left: list[str] = []
    orig = oc.FakeOutputCache.__call__

    def spy(self, func, args, kwargs):
        passes = self.passes
        out = orig(self, func, args, kwargs)
        if self.passes > passes:
            left.append(str(func))
        return out

    oc.FakeOutputCache.__call__ = spy
    try:
        warm = _facts(_run(on, src))
    finally:
        oc.FakeOutputCache.__call__ = orig
    assert warm == off
    assert not [f for f in left if "_foreach_" in f and "add_.Tensor" not in f], left


def test_gru_and_plain_rnn_layers_run_as_cudnn_and_say_which_do_not():
    """GRU and plain RNN stacks on the simulated GPU run as cuDNN's (their allocations are
    checked against an H200's in tests/course/test_gpu_fidelity.py) and the note says so;
    those CUDA would not give cuDNN (cuDNN switched off) stay on the CPU kernels' memory
    and are counted per kind; layers kept on the host say nothing."""
    src = """
import torch
x = torch.randn(7, 3, 16, device=DEVICE)
for layer in (torch.nn.GRU(16, 8), torch.nn.GRU(16, 8, num_layers=2), torch.nn.RNN(16, 8),
              torch.nn.RNN(16, 8, nonlinearity="relu"), torch.nn.LSTM(16, 8)):
    out, _ = layer.to(DEVICE)(x)
with torch.backends.cudnn.flags(enabled=False):
    out, _ = torch.nn.GRU(16, 8).to(DEVICE)(x)
    out, _ = torch.nn.RNN(16, 8, nonlinearity="relu").to(DEVICE)(x)
"""
    notes = _run(SimBackend(gpu="T4"), src.replace("DEVICE", "'cuda'")).notes
    cudnn = [n for n in notes if "ran as cuDNN's" in n]
    assert len(cudnn) == 1 and cudnn[0].startswith("LSTM, GRU, RNN layers ran as cuDNN's")
    cpu = [n for n in notes if "CPU kernels' memory" in n]
    assert len(cpu) == 1
    assert cpu[0].startswith("1 GRU call, 1 RNN (relu) call ran with the CPU kernels' memory")
    assert torch.backends.cudnn.enabled
    host = _run(SimBackend(gpu="T4"), src.replace("DEVICE", "'cpu'"))
    assert not any("CPU kernels' memory" in n or "ran as cuDNN" in n for n in host.notes), host.notes

def test_rnn_weights_live_in_one_flat_buffer_freed_with_their_module():
    """``.cuda()`` flattens an RNN's weights into one buffer, as a CUDA build's
    ``flatten_parameters`` does (one allocation; each weight a view of it); deleting the
    module frees it (the weights are set onto its storage: nothing may keep that alive)."""
    src = """
import torch
m = torch.nn.GRU(256, 512, bidirectional=True).cuda()
numel = sum(p.numel() for p in m.parameters())
sizes = {p.untyped_storage().nbytes() for p in m.parameters()}
blocks = torch.cuda.memory_stats()["allocation.all.current"]
held = torch.cuda.memory_allocated()
del m
left = torch.cuda.memory_allocated()
"""
    keys = ("numel", "sizes", "blocks", "held", "left")
    out = SimBackend(gpu="T4").execute(lambda n: (exec(src, n), [n[k] for k in keys])[1], {})
    assert out.error is None, out.error
    numel, sizes, blocks, held, left = out.value
    flat = numel * 4
    assert sizes == {flat} and blocks == 1
    assert held == -(-flat // 512) * 512 and left == 0


def test_an_rnn_out_of_memory_at_its_reserve_lets_its_workspace_go():
    """cuDNN's workspace is taken before the reserve; a reserve the card cannot hold raises
    the out-of-memory error with the workspace freed, as on a GPU (it was kept for good)."""
    src = """
import torch
lstm = torch.nn.LSTM(300, 1024, num_layers=2, bidirectional=True).cuda()
x = torch.randn(400, 256, 300, device="cuda")
before = torch.cuda.memory_allocated()
try:
    lstm(x)
except torch.OutOfMemoryError as exc:
    message = str(exc)
after = torch.cuda.memory_allocated()
"""
    out = SimBackend(gpu="T4").execute(
        lambda ns: (exec(src, ns), (ns["before"], ns["after"], ns["message"]))[1], {})
    assert out.error is None, out.error
    before, after, message = out.value
    # the reserve: 400 steps x 256 x 1024 x 4 B x 2 directions x (5 x 2 + 1) + 256 B = 8.59 GiB
    assert after == before and "Tried to allocate 8.59 GiB" in message


def test_an_out_of_memory_says_what_was_live_when_the_request_failed():
    """The doctor's "live by category" is read at the failed request, where cuDNN's
    workspace was still held: the categories add up to the live bytes the error gives."""
    from memmagic.doctor.oom import describe_oom

    src = """
import torch
lstm = torch.nn.LSTM(300, 1024, num_layers=2, bidirectional=True).cuda()
x = torch.randn(400, 256, 300, device="cuda")
lstm(x)
"""
    out = SimBackend(gpu="T4").execute(lambda ns: exec(src, ns), {})
    assert isinstance(out.error, torch.OutOfMemoryError)
    what = describe_oom(out.report, out.error)
    assert what.by_category["workspaces"] > 7 << 30  # the RNN's workspace, scaled: about 7.9 GiB
    assert sum(what.by_category.values()) == what.live == out.report.live_at_failure
