"""cuBLAS / cuBLASLt workspaces: what torch allocates through the caching allocator."""

from __future__ import annotations

import textwrap

import pytest

from memmagic.backends.sim import SimBackend
from memmagic.backends.sim.workspaces import cublas_workspace_size, cublaslt_workspace_size

CUBLAS = 4096 * 1024 * 2 + 16 * 1024 * 8  # torch's default off Hopper: 8,519,680 B
LT = 1024 * 1024


def run(src: str, **options):
    code = compile(textwrap.dedent(src), "<cell>", "exec")
    return SimBackend(**options).execute(lambda n: exec(code, n), {})


def test_sizes_follow_torch():
    assert cublas_workspace_size((8, 6), {}) == CUBLAS == 8_519_680
    assert cublas_workspace_size((9, 0), {}) == 32 * 2**20          # Hopper
    assert cublas_workspace_size((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * 2**20
    assert cublas_workspace_size((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024
    assert cublas_workspace_size((8, 0), {"CUBLAS_WORKSPACE_CONFIG": "junk"}) == CUBLAS
    assert cublaslt_workspace_size((8, 0), {}) == LT
    assert cublaslt_workspace_size((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024
    assert cublaslt_workspace_size((8, 0), {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 0
    assert cublaslt_workspace_size((8, 0), {"CUBLASLT_WORKSPACE_SIZE": "4096",
                                            "TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}) == 4 * 2**20


def test_first_matmul_takes_the_workspace_and_keeps_it():
    out = run("""
        import torch
        a = torch.ones(64, 64, device="cuda")
        b = a @ a           # cuBLAS: the main thread's workspace
        c = a @ a           # the same handle: nothing new
        del b, c
    """, gpu="A10G")
    assert out.error is None, out.error
    assert out.report.after == 64 * 64 * 4 + CUBLAS
    assert out.report.breakdown["workspaces"] == CUBLAS
    assert any("cuBLAS" in n for n in out.report.notes)


def test_backward_runs_on_a_thread_of_its_own():
    out = run("""
        import torch
        lin = torch.nn.Linear(64, 64, bias=False).cuda()
        lin(torch.ones(8, 64, device="cuda")).sum().backward()
    """, gpu="A10G")
    # forward mm on the main thread, backward mm on autograd's device thread
    assert out.report.breakdown_before["workspaces"] == 0
    ws = out.report.after - out.report.before
    params_and_grads = 2 * 64 * 64 * 4
    assert ws == 2 * CUBLAS + params_and_grads


def test_hopper_and_the_environment(monkeypatch):
    out = run("import torch\nx = torch.ones(4, 4, device='cuda') @ torch.ones(4, 4, device='cuda')",
              gpu="H100-80GB")
    assert out.report.breakdown["workspaces"] == 32 * 2**20
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    out = run("import torch\nx = torch.ones(4, 4, device='cuda') @ torch.ones(4, 4, device='cuda')",
              gpu="A10G")
    assert out.report.breakdown["workspaces"] == 0 and out.report.after == 512


def test_cpu_kernels_and_cpu_reports_have_no_workspaces():
    out = run("import torch\nx = torch.ones(4, 4, device='cuda') @ torch.ones(4, 4, device='cuda')",
              kernels="cpu")
    assert out.report.breakdown["workspaces"] == 0
    assert "workspaces" not in [k for k, _, _ in out.report.breakdown_rows()]


def test_the_workspace_can_be_what_does_not_fit():
    out = run("import torch\na = torch.empty(60 * 2**20 // 4, device='cuda')\nb = a[:64].view(8, 8) @ a[:64].view(8, 8)",
              gpu_memory="64MiB")
    assert out.error is not None and "out of memory" in str(out.error)
    assert "aten.mm" in str(out.error)
