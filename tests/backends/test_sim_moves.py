"""Every way of moving to the GPU works on the simulated device, and devices it does not
have say so (issue 14, item 5)."""

from __future__ import annotations

import pytest

from memmagic.backends.sim import SimBackend, SimulationUnsupported


def _run(src: str):
    out = SimBackend().execute(lambda ns: exec("import torch\n" + src, ns), {})
    return out


TENSOR_MOVES = {
    "to(device='cuda')": "x = torch.ones(1024).to(device='cuda')",
    "to(0)": "x = torch.ones(1024).to(0)",
    "to(device=0)": "x = torch.ones(1024).to(device=0)",
    "to(cuda_tensor)": "c = torch.zeros(128, device='cuda'); x = torch.ones(1024).to(c)",
    "to('cuda:0', non_blocking=True)": "x = torch.ones(1024).to('cuda:0', non_blocking=True)",
    "cuda(0)": "x = torch.ones(1024).cuda(0)",
    "to(torch.device('cuda', 0))": "x = torch.ones(1024).to(torch.device('cuda', 0))",
}


@pytest.mark.parametrize("form", list(TENSOR_MOVES))
def test_tensor_moves_reach_the_simulated_gpu(form):
    out = _run(TENSOR_MOVES[form] + "\nassert x.is_cuda and x.device == torch.device('cuda', 0)")
    assert out.error is None, out.error
    # the 4 KiB tensor is on the GPU (plus the 512 B of the cuda_tensor form)
    assert out.report.after == 4096 + (512 if "cuda_tensor" in form else 0)


MODULE_MOVES = {
    "to(device='cuda')": "m = torch.nn.Linear(16, 16).to(device='cuda')",
    "to(0)": "m = torch.nn.Linear(16, 16).to(0)",
    "to(cuda_tensor)": "c = torch.zeros(128, device='cuda'); m = torch.nn.Linear(16, 16).to(c)",
    "to('cuda:0', non_blocking=True)": "m = torch.nn.Linear(16, 16).to('cuda:0', non_blocking=True)",
    "cuda(0)": "m = torch.nn.Linear(16, 16).cuda(0)",
}


@pytest.mark.parametrize("form", list(MODULE_MOVES))
def test_module_moves_reach_the_simulated_gpu(form):
    src = MODULE_MOVES[form] + (
        "\nassert all(p.is_cuda for p in m.parameters())"
        "\ny = m(torch.ones(4, 16, device='cuda'))")  # no false device-mismatch error
    out = _run(src)
    assert out.error is None, out.error
    params = 1024 + 512  # 16x16 fp32 weight, 16 fp32 bias rounded to 512 B
    extra = 512 if "cuda_tensor" in form else 0
    # the first matmul takes torch's cuBLAS workspace (8,519,680 B off Hopper) and, for
    # Linear's bias path, cuBLASLt's (1 MiB); both stay, as on a GPU
    workspaces = 8_519_680 + 1_048_576
    assert out.report.after == params + extra + 2 * 512 + workspaces  # + input and output
    assert out.report.breakdown["workspaces"] == workspaces


def test_module_to_a_cpu_tensor_stays_on_the_host():
    out = _run("c = torch.zeros(1); m = torch.nn.Linear(16, 16).cuda().to(c)\n"
               "assert not m.weight.is_cuda")
    assert out.error is None, out.error
    assert out.report.after == 0


@pytest.mark.parametrize("src, says", [
    ("x = torch.ones(4, device='cuda:1')", "'cuda:1' is not simulated"),
    ("x = torch.ones(4).to('cuda:1')", "'cuda:1' is not simulated"),
    ("x = torch.ones(4).cuda(1)", "is not simulated"),
    ("x = torch.ones(4).to(1)", "is not simulated"),
    ("m = torch.nn.Linear(2, 2).to(1)", "is not simulated"),
    ("x = torch.ones(4, device='mps')", "'mps' is not simulated"),
    ("x = torch.ones(4).to('mps')", "'mps' is not simulated"),
])
def test_devices_the_simulation_does_not_have_say_so(src, says):
    out = _run(src)
    assert isinstance(out.error, SimulationUnsupported)
    assert says in str(out.error) and "line 2" in str(out.error)
    assert "\n" not in str(out.error)


def test_cpu_and_meta_devices_are_accepted():
    out = _run("a = torch.ones(4, device='meta')\nb = torch.ones(4, device='cpu').to('cpu')\n"
               "assert not a.is_cuda and not b.is_cuda")
    assert out.error is None, out.error
    assert out.report.after == 0


def test_a_model_built_on_the_meta_device_gets_its_memory_from_to_empty():
    """nanochat's and torchtitan's way to build a model: its shapes on the meta device
    (values computed there, a rotary table from ``arange``, stay meta: no values, no
    memory), then storage on the GPU by ``to_empty``, whose swap of a fake parameter of
    another device ``param.data = ...`` cannot make."""
    out = _run("with torch.device('meta'):\n"
               "    m = torch.nn.Linear(256, 256)\n"
               "    t = torch.arange(0, 64, 2, dtype=torch.float32)\n"
               "    freqs = torch.outer(torch.arange(128.0), 1.0 / (10000 ** (t / 64)))\n"
               "assert freqs.device.type == 'meta' and freqs.shape == (128, 32)\n"
               "assert (t + 1).device.type == 'meta' and (2 ** t).device.type == 'meta'\n"
               "m.to_empty(device='cuda')\n"
               "assert m.weight.is_cuda and m.bias.is_cuda and m.weight.requires_grad\n"
               "m(torch.randn(8, 256, device='cuda')).sum().backward()\n"
               "assert m.weight.grad.shape == (256, 256)\n")
    assert out.error is None, out.error
    # the weight and bias and their gradients (beside cuBLAS's workspaces), no meta tensor
    r = out.report
    assert r.breakdown["parameters"] == r.breakdown["gradients"] == (256 * 256 + 256) * 4
    assert r.after == 2 * (256 * 256 + 256) * 4 + r.breakdown["workspaces"]


@pytest.mark.parametrize("build", ["torch.nn.Embedding(8192, 1024).cuda()",
                                   "torch.nn.Embedding(8192, 1024, device='meta')"
                                   ".to_empty(device='cuda')"])
def test_a_parameters_storage_stays_a_parameters_when_the_model_is_cast(build):
    """``model.to(torch.bfloat16)`` on the GPU holds the fp32 weight and its bf16 copy at
    once: both are the parameter's (they were counted as "other")."""
    out = _run(f"m = {build}\nm.to(torch.bfloat16)\nassert m.weight.dtype == torch.bfloat16")
    assert out.error is None, out.error
    r = out.report
    assert r.peak == 8192 * 1024 * (4 + 2) and r.breakdown["parameters"] == r.peak
    assert r.after == 8192 * 1024 * 2


def test_a_generator_on_the_gpu_draws_and_says_where_it_is():
    """``torch.Generator(device="cuda")`` (nanochat's sampling, a diffusers pipeline's seed)
    raised "Cannot get CUDA generator without ATen_cuda library"; a CPU one stays torch's."""
    out = _run("g = torch.Generator(device=torch.device('cuda'))\n"
               "assert g.manual_seed(3) is g and g.initial_seed() == 3\n"
               "assert g.device == torch.device('cuda', 0) and isinstance(g, torch.Generator)\n"
               "x = torch.randn(64, 64, device='cuda', generator=g)\n"
               "probs = torch.softmax(torch.randn(4, 100, device='cuda'), -1)\n"
               "s = torch.multinomial(probs, 1, generator=g)\n"
               "assert s.shape == (4, 1) and s.device == g.device\n"
               "h = torch.Generator()\n"
               "assert type(h) is torch._C.Generator and h.device.type == 'cpu'\n"
               "assert isinstance(torch.default_generator, torch.Generator)\n")
    assert out.error is None, out.error
    import torch

    assert torch.Generator is torch._C.Generator  # put back


# -- out of memory that adds up (issue 14, item 6) -----------------------------------------------
def test_a_request_bigger_than_the_card_is_reported_apart():
    out = SimBackend(gpu_memory="6GiB").execute(
        lambda ns: exec("import torch\nx = torch.empty(7 * 2**30, dtype=torch.uint8, device='cuda')", ns), {})
    r = out.report
    assert r.failed_request == 7 << 30 and r.live_at_failure == 0
    assert r.peak == r.after == 0 and r.reserved_peak == 0 and r.fits is False
    assert "0 B is allocated by PyTorch" in str(out.error)
    assert "out of memory" in r.summary() and "7.00 GiB failed with 0 B live" in r.summary()


def test_live_bytes_at_the_failure_match_the_error_text():
    from memmagic import format_bytes

    src = ("import torch\na = torch.empty(4 * 2**30, dtype=torch.uint8, device='cuda')\n"
           "b = torch.empty(1 * 2**30, dtype=torch.uint8, device='cuda')\n"
           "c = torch.empty(3 * 2**30, dtype=torch.uint8, device='cuda')\n")
    out = SimBackend(gpu_memory="6GiB").execute(lambda ns: exec(src, ns), {})
    r = out.report
    assert r.live_at_failure == 5 << 30 == r.peak and r.reserved_peak <= 6 << 30
    assert f"{format_bytes(r.live_at_failure)} is allocated by PyTorch" in str(out.error)
    assert r.breakdown["other"] == 5 << 30


def test_code_that_catches_the_oom_goes_on_like_on_a_gpu():
    # a batch-size finder catches the OOM, frees, and tries a smaller size
    src = ("import torch\nfits = None\n"
           "for n in (8, 4, 2):\n"
           "    try:\n"
           "        x = torch.empty(n * 2**30, dtype=torch.uint8, device='cuda')\n"
           "        fits = n\n        break\n"
           "    except torch.OutOfMemoryError:\n"
           "        pass\n"
           "assert fits == 4, fits\n")
    out = SimBackend(gpu_memory="6GiB").execute(lambda ns: exec(src, ns), {})
    assert out.error is None, out.error
    assert out.report.peak == 4 << 30 and out.report.failed_request is None


def test_a_caught_oom_frees_what_the_failed_frames_held():
    # the doubling loop of the field's batch finders: the input of the batch that failed
    # is only held by the error's traceback; once the handler ends it is freed and
    # empty_cache() returns its block, as on a GPU (it stayed allocated to the cell's end).
    # What stays: the weight and the cuBLAS workspace.
    src = ("import torch\nbig = torch.nn.Linear(4096, 4096, bias=False).cuda()\nbs = 1\n"
           "while True:\n"
           "    try:\n"
           "        out = big(torch.randn(bs * 1024, 4096, device='cuda'))\n"
           "        del out\n        bs *= 2\n"
           "    except torch.cuda.OutOfMemoryError:\n"
           "        break\n"
           "    finally:\n"
           "        torch.cuda.empty_cache()\n"
           # 256 x 1024 x 4096 fp32: a 4 GiB input fits beside the weight, its output not
           "assert bs == 256, bs\n"
           "assert torch.cuda.memory_allocated() < 100 * 2**20, torch.cuda.memory_allocated()\n"
           "assert torch.cuda.memory_reserved() < 100 * 2**20, torch.cuda.memory_reserved()\n")
    out = SimBackend(gpu_memory="6GiB").execute(lambda ns: exec(src, ns), {})
    assert out.error is None, out.error
    weight = 4096 * 4096 * 4
    assert weight <= out.report.after < weight + (32 << 20), out.report.after
    assert out.report.reserved_after < weight + (32 << 20), out.report.reserved_after
