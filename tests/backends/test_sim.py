"""The simulated CUDA device: cells written for a GPU, run on fake tensors."""

from __future__ import annotations

import os
import textwrap
import warnings

import pytest
import torch

from memmagic.core import _torch_private as priv
from memmagic.backends import get_backend
from memmagic.backends.sim import (
    SimBackend,
    SimulatedOutOfMemoryError,
    SimulatedValue,
    SimulatedValueError,
    SimulationBudgetExceeded,
    SimulationUnsupported,
    resolve_target,
)

from conftest import global_state


def run(src: str, ns: dict | None = None, **options):
    code = compile(textwrap.dedent(src), "<cell>", "exec")
    ns = {} if ns is None else ns
    out = SimBackend(**options).execute(lambda n: exec(code, n), ns)
    return out, ns


def sim_state() -> dict:
    import torch.optim.adam as adam
    import torch.utils.data as tud
    from torch._subclasses.fake_tensor import FakeTensor

    x = torch.ones(64, requires_grad=True)
    mask_grad_fn = type(torch.nn.functional.dropout(x, 0.5).grad_fn).__name__
    return {
        **global_state(),
        "function_modes": priv.function_mode_depth(),
        "cuda_available": torch.cuda.is_available(),
        "memory_allocated": torch.cuda.memory_allocated,
        "autocast": torch.autocast, "cuda_amp_autocast": torch.cuda.amp.autocast,
        "set_default_device": torch.set_default_device,
        "fake_device": FakeTensor.__dict__["device"],
        "fake_mode_deepcopy": priv.FakeTensorMode.__dict__.get("__deepcopy__"),
        "foreach_default": adam._default_to_fused_or_foreach,
        "swap_tensors": torch.utils.swap_tensors,
        "make_subclass": torch.Tensor.__dict__.get("_make_subclass"),  # inherited: absent
        "make_wrapper_subclass": torch.Tensor.__dict__.get("_make_wrapper_subclass"),  # ditto
        "hf_async_load": os.environ.get("HF_DEACTIVATE_ASYNC_LOAD"),
        "loader_iter": tud.DataLoader.__dict__["_get_iterator"],
        "dropout_backward": mask_grad_fn,
        "autocast_softmax": _cpu_autocast_softmax_dtype(),
    }


class Recorder:
    """A side channel out of a simulated cell (the sandbox would copy a plain dict)."""

    def __init__(self, target: dict) -> None:
        self.__dict__["_set"] = target.__setitem__

    def __setitem__(self, key, value) -> None:
        self._set(key, value)

    def __deepcopy__(self, memo):
        return self


def _cpu_autocast_softmax_dtype():
    with torch.autocast("cpu", dtype=torch.float16):
        return torch.softmax(torch.ones(2, 2, dtype=torch.float16), -1).dtype


# -- requirement 1: GPU cells run unchanged --------------------------------------------------
def test_device_spellings_and_cuda_queries():
    out, ns = run("""
        import torch
        a = torch.zeros(1024, device="cuda")
        b = torch.ones(256, device=torch.device("cuda")).cuda()
        c = torch.randn(256).to("cuda")
        with torch.device("cuda"):
            d = torch.empty(256)
        torch.set_default_device("cuda")
        e = torch.empty(256)
        torch.set_default_device("cpu")
        f = torch.empty(256)
        devices = [str(t.device) for t in (a, b, c, d, e, f)]
        flags = (a.is_cuda, f.is_cuda, torch.cuda.is_available(), torch.cuda.device_count())
        alloc = torch.cuda.memory_allocated()
        props = torch.cuda.get_device_properties(0)
        torch.cuda.reset_peak_memory_stats()
        g = torch.empty(1024, device="cuda")
        del g
        peak_after_reset = torch.cuda.max_memory_allocated()
        torch.cuda.synchronize(); torch.cuda.empty_cache()
        info = (alloc, peak_after_reset, props.name, props.total_memory, torch.cuda.memory_reserved())
    """, gpu="T4")
    assert out.error is None, out.error
    # the namespace got placeholders back; read the values through the report instead
    r = out.report
    assert r.peak == 4096 + 1024 * 3 + 1024 + 4096  # a, b, c, d, e (512-rounded) and g
    assert r.host_peak == 1024  # c before its copy to the GPU, later f
    assert r.gpu_name == "T4" and r.gpu_memory == resolve_target("T4").total_memory
    assert r.device == "simulated cuda:0 (T4)"
    assert isinstance(ns["devices"], SimulatedValue)


def test_values_seen_inside_the_cell():
    seen: dict = {}
    ns = {"seen": Recorder(seen)}
    out, _ = run("""
        import torch
        a = torch.zeros(1024, device="cuda")
        seen["devices"] = [str(a.device), str(a.cpu().device), str(torch.device("cuda"))]
        seen["alloc"] = torch.cuda.memory_allocated()
        seen["props"] = (torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)
        x = torch.randn(8, 8, device="cuda").half()
        seen["half"] = (x.dtype, str(x.device))
    """, ns, gpu="RTX3060")
    assert out.error is None, out.error
    assert seen["devices"] == ["cuda:0", "cpu", "cuda"]
    assert seen["alloc"] == 4096
    assert seen["props"] == ("RTX3060", resolve_target("rtx3060").total_memory)
    assert seen["half"] == (torch.float16, "cuda:0")


def test_zoo_gpu_cell_runs_and_reports(clean_state):
    from memmagic import zoo

    out, _ = run(zoo.step_source("transformer", device="cuda", amp=True, checkpointing=True))
    assert out.error is None, out.error
    r = out.report
    assert r.backend == "sim" and r.reserved_peak >= r.peak > r.before == 0
    assert r.breakdown["parameters"] > 0
    assert any("flash" in n or "efficient" in n for n in r.notes)


def test_training_loop_with_dataloader_gradscaler_and_modules():
    out, ns = run("""
        import torch, torch.nn as nn, torch.nn.functional as F
        from torch.utils.data import DataLoader, TensorDataset
        from torch.utils.checkpoint import checkpoint, checkpoint_sequential
        data = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
        loader = DataLoader(data, batch_size=16, shuffle=True, num_workers=2)
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.seq = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1))
                self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
                self.out = nn.Linear(32, 4)
            def forward(self, x):
                h = checkpoint_sequential(self.seq, 2, x, use_reentrant=False)
                h = checkpoint(lambda t: self.attn(t, t, t)[0], h[:, None, :], use_reentrant=True)
                return self.out(h[:, 0])
        model = Net().cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cuda")
        for epoch in range(2):
            for x, y in loader:
                x, y = x.cuda(non_blocking=True), y.cuda()
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        with torch.autograd.graph.save_on_cpu():
            model(torch.randn(4, 16, device="cuda")).sum().backward()
        print(f"loss {loss.item():.3f}")
        momentum = [len(s) for s in opt.state.values()]
    """)
    assert out.error is None, out.error
    assert any("workers" in n for n in out.report.notes)
    assert any("depend on data were read" in n for n in out.report.notes)  # loss.item()


def test_optimizer_step_count_stays_real_and_found_inf_reads_zero():
    seen = {}
    out, _ = run("""
        import torch
        m = torch.nn.Linear(4, 4).cuda()
        opt = torch.optim.Adam(m.parameters())
        scaler = torch.amp.GradScaler("cuda")
        for _ in range(3):
            with torch.autocast("cuda"):
                loss = m(torch.randn(2, 4, device="cuda")).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        seen["step"] = opt.state[m.weight]["step"].item()
        seen["loss"] = loss.item()
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen["step"] == 3.0  # the optimizer stepped: found_inf read 0, the count is real
    assert seen["loss"] == 1.0  # a placeholder


# -- requirement 3: target GPU and out of memory ------------------------------------------
def test_out_of_memory_names_op_and_module():
    out, ns = run("""
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
        x = torch.randn(4096, 1024, device="cuda")
        y = model(x)
    """, gpu_memory="96MiB")
    err = out.error
    assert isinstance(err, SimulatedOutOfMemoryError) and isinstance(err, torch.OutOfMemoryError)
    assert "Tried to allocate 64.00 MiB" in str(err) and "in module model.0 during forward" in str(err)
    r = out.report
    assert r.fits is False and r.gpu_memory == 96 << 20
    # the failed request is reported apart; what was held never exceeds the card
    assert r.failed_request == 64 << 20 and r.reserved_peak <= r.gpu_memory
    assert r.peak <= r.gpu_memory and r.live_at_failure <= r.peak
    assert "OutOfMemoryError" in r.error



@pytest.mark.parametrize("where", ["forward", "backward"])
def test_out_of_memory_is_one_clean_error(where):
    # raised as on a GPU: no "During handling of the above exception" with the simulated
    # allocator's internal AllocatorFull in front of it
    import traceback

    out, _ = run(f"""
        import torch
        w = torch.randn(2048, 2048, device="cuda", requires_grad=True)
        x = torch.randn(2048, 2048, device="cuda")
        y = (x @ w).relu() @ w
        if {where == "backward"!r}:
            y.sum().backward()
        else:
            z = torch.empty(16 << 20, device="cuda")
    """, gpu_memory="80MiB")
    err = out.error
    assert isinstance(err, SimulatedOutOfMemoryError), err
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)
    text = "".join(traceback.format_exception(err))
    assert "During handling" not in text and "AllocatorFull" not in text
    assert text.count("Traceback (most recent call last)") == 1

def test_gpu_table_and_sizes():
    for name in ("laptop-4GB", "laptop-6GB", "laptop-8GB", "RTX3060", "T4", "RTX4090",
                 "A100-40GB", "A100-80GB", "H100"):
        assert resolve_target(name).total_memory > 3 << 30
    assert resolve_target(None, "10GiB").total_memory == 10 << 30
    assert resolve_target("T4", 1 << 30).total_memory == 1 << 30
    with pytest.raises(ValueError, match="unknown GPU"):
        resolve_target("GTX9999")
    b = get_backend("sim", gpu="a100", gpu_memory="40GB")
    assert b.target.total_memory == 40 * 10**9


# -- requirement 4: nothing real is touched ----------------------------------------------------
def test_earlier_objects_stay_bit_identical():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    x = torch.randn(4, 8)
    history = [1.0]
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    opt_snapshot = {k: {n: t.clone() for n, t in s.items()} for k, s in enumerate(opt.state.values())}
    grads = [p.grad.clone() for p in model.parameters()]

    def helper():  # an earlier cell's function: sees the namespace through __globals__
        return model(x)

    ns = {"torch": torch, "model": model, "opt": opt, "x": x, "history": history, "helper": helper}
    helper.__globals__.update()  # (defined here; ns below is what the cell sees)
    out, ns = run("""
        model.cuda().half()
        model.float()
        for state in opt.state.values():  # a GPU needs the optimizer state moved too
            for k, v in state.items():
                state[k] = v.cuda()
        for _ in range(2):
            loss = model(x.cuda()).sum()
            loss.backward()
            opt.step()
        history.append(loss.item())
        x.mul_(0)
        x = torch.zeros(3)
        new_tensor = torch.ones(3, device="cuda")
        def later(): return 1
    """, ns)
    assert out.error is None, out.error
    for k, v in model.state_dict().items():
        assert v.device.type == "cpu" and torch.equal(v, snapshot[k]), k
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g) and p.dtype == torch.float32
    for k, s in enumerate(opt.state.values()):
        for n, t in s.items():
            assert torch.equal(t, opt_snapshot[k][n])
    assert ns["x"] is x and torch.count_nonzero(x) > 0
    assert ns["history"] == [1.0] and ns["model"] is model
    assert isinstance(ns["new_tensor"], SimulatedValue)
    assert ns["later"]() == 1  # functions the cell defined stay
    with pytest.raises(SimulatedValueError, match="without --backend sim"):
        ns["new_tensor"] + 1
    with pytest.raises(SimulatedValueError):
        torch.add(ns["new_tensor"], 1)
    assert "without --backend sim" in repr(ns["loss"])


def test_functions_from_earlier_cells_see_fake_copies():
    ns: dict = {}
    exec("import torch\nw = torch.ones(4)\ndef f():\n    return w.mul_(2)\n", ns)
    out, ns = run("y = f().cuda()", ns)
    assert out.error is None, out.error
    assert torch.equal(ns["w"], torch.ones(4))


def test_value_returned_by_the_cell_is_a_placeholder():
    out = SimBackend().execute(lambda ns: torch.ones(3, device="cuda") * 2, {})
    assert out.error is None and isinstance(out.value, SimulatedValue)
    # shown as the GPU run would show it (its values follow from constants here), marked
    assert repr(out.value).startswith("tensor([2., 2., 2.], device='cuda:0')\n[an object of the simulated GPU")
    with pytest.raises(SimulatedValueError):
        out.value + 1


def test_measure_callable():
    def step():
        return torch.randn(256, 256, device="cuda").sum()

    out = get_backend("sim").measure(step)
    assert out.error is None and out.report.peak == 256 * 256 * 4 + 512  # + the sum


# -- requirement 5: data-dependent values and budget ---------------------------------------------
def test_data_dependent_loop_hits_the_budget():
    out, _ = run("""
        import torch
        x = torch.ones(10, device="cuda")
        while x.sum().item() > 0:
            x = x * 0.5 + 1
    """, max_ops=5_000)
    assert isinstance(out.error, SimulationBudgetExceeded)
    assert "max_ops" in str(out.error)
    assert out.report.peak > 0


def test_tolist_numpy_and_print():
    seen = {}
    out, _ = run("""
        import torch
        t = torch.arange(6, device="cuda").view(2, 3)
        seen["list"] = t.tolist()
        seen["np"] = t.float().cpu().numpy().shape
        seen["repr"] = repr(t)
        seen["bool"] = bool((t > 2).any())
        r = torch.randn(2, 3, device="cuda")
        seen["rlist"] = r.tolist()
        seen["rrepr"] = repr(r)
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    # values that follow from shapes and constants are real ...
    assert seen["list"] == [[0, 1, 2], [3, 4, 5]] and seen["np"] == (2, 3)
    assert "[3, 4, 5]" in seen["repr"] and "cuda:0" in seen["repr"]
    assert seen["bool"] is True
    # ... data-dependent ones are placeholders, and say so
    assert seen["rlist"] == [[1.0] * 3] * 2
    assert "simulated" in seen["rrepr"] and "cuda:0" in seen["rrepr"]


# -- requirement 6: clear errors, never a crash --------------------------------------------------------
@pytest.mark.parametrize("line", [
    "g = torch.cuda.CUDAGraph()",
    "p = torch.cuda.MemPool()",
    "i = torch.nonzero(torch.randn(3, device='cuda'))",
    "torch.autograd.gradcheck(torch.sin, torch.ones(2, dtype=torch.float64, requires_grad=True))",
    "n = torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)], layout=torch.jagged)",
    "n = torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)], device='cuda')",
    ("from torch._higher_order_ops.while_loop import while_loop; i = torch.zeros((), "
     "device='cuda'); while_loop(lambda i: i < 3, lambda i: (i + 1,), (i,))"),
])
def test_unsupported_names_the_line(line):
    out, _ = run(f"import torch\nx = 1\n{line}\n")
    assert isinstance(out.error, SimulationUnsupported), out.error
    assert "line 3" in str(out.error) and "--backend cpu" in str(out.error)


def test_cells_own_errors_pass_through():
    out, _ = run("import torch\nx = torch.ones(3, device='cuda') @ torch.ones(4, device='cuda')\n")
    assert isinstance(out.error, RuntimeError) and not isinstance(out.error, SimulationUnsupported)


# -- requirement 7: deterministic --------------------------------------------------------------------------
def test_same_cell_same_bytes():
    from memmagic import zoo

    src = zoo.step_source("nanogpt", device="cuda", amp=True)
    a, _ = run(src)
    b, _ = run(src)
    ra, rb = a.report.to_dict(), b.report.to_dict()
    for k in ("wall_s",):
        ra.pop(k), rb.pop(k)
    assert ra == rb


# -- global state is restored -------------------------------------------------------------------------------
@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
def test_global_state_restored_after_exception(exc):
    before = sim_state()
    rng = torch.get_rng_state()
    ns = {"exc": exc}
    out, _ = run("""
        import torch
        torch.manual_seed(123)
        torch.set_default_dtype(torch.float64)
        torch.set_default_device("cuda")
        m = torch.nn.Linear(4, 4)
        with torch.autocast("cuda"):
            y = torch.nn.functional.dropout(m(torch.ones(2, 4)), 0.5)
            raise exc("boom")
    """, ns)
    assert isinstance(out.error, exc)
    assert torch.equal(torch.get_rng_state(), rng)
    assert sim_state() == before


def test_global_state_restored_after_success():
    before = sim_state()
    out, _ = run("import torch\ntorch.set_grad_enabled(False)\nx = torch.ones(3, device='cuda')\n")
    assert out.error is None
    assert sim_state() == before


def _tf32_settings() -> dict:
    b = torch.backends
    paths = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul")
    out = {}
    for path in paths:
        obj = b
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part)
        out[path] = obj.fp32_precision
    return out


@pytest.mark.parametrize("setup", ["", "torch.backends.fp32_precision = 'tf32'",
                                   "torch.set_float32_matmul_precision('high')"])
def test_tf32_settings_in_either_api_are_put_back(setup):
    """torch's newer TF32 API (``torch.backends.fp32_precision = "tf32"``, what transformers'
    ``TrainingArguments(tf32=True)`` sets) beside the older flags: torch refuses to read the
    older ones once the two mix, which failed every simulated cell after such a setting;
    either way a cell's settings are put back after it."""
    saved = _tf32_settings(), torch.get_float32_matmul_precision()
    try:
        exec(setup)
        before = _tf32_settings()
        for cell in ("torch.backends.fp32_precision = 'tf32'",
                     "torch.set_float32_matmul_precision('medium')",
                     "torch.backends.cuda.matmul.allow_tf32 = True",
                     "y = torch.ones(2, device='cuda') @ torch.ones(2, device='cuda')"):
            out, _ = run("import torch\n" + cell + "\n")
            assert out.error is None, (setup, cell, out.error)
            assert _tf32_settings() == before, (setup, cell)
    finally:
        torch.set_float32_matmul_precision(saved[1])
        for path, value in saved[0].items():
            obj = torch.backends
            for part in filter(None, path.split(".")):
                obj = getattr(obj, part)
            obj.fp32_precision = value


def test_cuda_autocast_to_float32_is_entered_as_on_a_gpu():
    """llm.c's train_gpt2.py enters ``torch.amp.autocast("cuda", dtype=torch.float32)`` by
    default: CUDA autocast takes it (ops cast to or stay in fp32), without the warning and
    the disabling of CPU autocast's check."""
    seen: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = run("""
            import torch
            w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
            with torch.amp.autocast(device_type="cuda", dtype=torch.float32):
                seen["on"] = torch.is_autocast_enabled("cuda")
                seen["dtype"] = torch.get_autocast_dtype("cuda")
                seen["mm"] = (w @ w).dtype  # a bf16 matmul is cast up to the target
            seen["after"] = torch.is_autocast_enabled("cuda")
            """, {"seen": Recorder(seen)}, gpu="T4")
    assert out.error is None, out.error
    assert seen == {"on": True, "dtype": torch.float32, "mm": torch.float32, "after": False}


def test_options_are_checked():
    with pytest.raises(TypeError):
        SimBackend(device=0)
    with pytest.raises(ValueError):
        SimBackend(kernels="tpu")


def test_cuda_autocast_policy_lives_only_inside_autocast_of_a_run():
    from memmagic.backends.sim import autocast as sim_autocast

    def policy_on() -> bool:  # CUDA keeps softmax in fp32 under autocast; the CPU does not
        return priv.has_kernel("aten::softmax.int", "AutocastCPU")

    installs = []
    real_install = sim_autocast.install_cuda_autocast_policy

    def counting_install():
        installs.append(1)
        return real_install()

    seen: list[bool] = []
    ns = {"probe": lambda: seen.append(policy_on())}
    assert not policy_on()
    import memmagic.backends.sim.backend as sim_backend_mod
    orig = sim_backend_mod.install_cuda_autocast_policy
    sim_backend_mod.install_cuda_autocast_policy = counting_install
    try:
        out, _ = run("""
            import torch
            probe()
            x = torch.randn(4, 4, device="cuda")
            """, ns)
        assert out.error is None and installs == [] and seen == [False]  # no autocast: never
        out, ns2 = run("""
            import torch
            x = torch.randn(4, 4, device="cuda")
            with torch.autocast("cuda"):
                probe()
                y = x.softmax(-1)
            leaked = torch.autocast("cuda")
            """, ns)
        assert out.error is None and installs == [1] and seen == [False, True]
        assert not policy_on()                      # taken away after the run
        with torch.autocast("cpu"):                # an autocast object made in the run,
            pass
        leaked = ns2.get("leaked")
        if leaked is not None and not isinstance(leaked, SimulatedValue):
            with leaked:                            # ... entered afterwards, installs nothing
                pass
        assert installs == [1] and not policy_on()
    finally:
        sim_backend_mod.install_cuda_autocast_policy = orig


def test_a_fresh_namespace_can_be_simulated_twice():
    # exec() adds __builtins__ to a fresh dict during the run: it is not a name the cell
    # created, and must not become a placeholder (the next exec would fail in CPython)
    ns: dict = {}
    for _ in range(2):
        out, ns = run("import torch\nx = torch.randn(4, 4, device='cuda')\n", ns)
        assert out.error is None
        assert isinstance(ns["__builtins__"], dict) and isinstance(ns["x"], SimulatedValue)


def test_sim_modules_import_inward_only():
    """No two modules of the simulation import each other (also through a chain, also
    inside functions), and none imports another's private name."""
    import ast
    import pathlib

    import memmagic.backends.sim as sim_pkg

    root = pathlib.Path(sim_pkg.__file__).parent
    graph: dict[str, set[str]] = {}
    private: list[str] = []
    for path in root.glob("*.py"):
        deps = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [a.name for a in node.names]
                deps.update(n.split(".")[0] for n in names)
                private += [f"{path.stem}: {a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert private == []
    visiting: list[str] = []
    done: set[str] = set()

    def visit(mod: str) -> None:
        assert mod not in visiting, f"import cycle: {' -> '.join(visiting + [mod])}"
        if mod in done or mod not in graph:
            return
        visiting.append(mod)
        for dep in graph[mod]:
            visit(dep)
        visiting.pop()
        done.add(mod)

    for mod in graph:
        if mod != "__init__":
            visit(mod)
