"""%%gpumem through a real IPython InteractiveShell, asserting on the returned report."""
from __future__ import annotations

import gc
import re
import weakref

import pytest
import torch

from memmagic import MemoryReport

P_LINEAR = (256 * 128 + 128) * 4  # nn.Linear(256, 128) parameters, fp32


def gpumem(ip, cell, opts="--backend cpu -o -q --no-chart"):
    return ip.run_cell_magic("gpumem", opts, cell)


def test_load_registers_line_and_cell_magic(ip):
    magics = ip.magics_manager.magics
    assert "gpumem" in magics["cell"] and "gpumem" in magics["line"]


def test_unload_removes_the_magics(ip):
    ip.run_line_magic("unload_ext", "memmagic")
    magics = ip.magics_manager.magics
    assert "gpumem" not in magics["cell"] and "gpumem" not in magics["line"]
    res = ip.run_cell("%%gpumem\nx = 1")
    assert res.error_in_exec is not None  # no such magic any more
    ip.run_line_magic("load_ext", "memmagic")


def test_help_is_generated_from_the_options(ip):
    doc = ip.find_cell_magic("gpumem").__doc__
    for opt in ("--backend", "--device", "--gpu", "--gpu-memory", "-o", "-v", "-q"):
        assert opt in doc


def test_parameters_exact(ip):
    r = gpumem(ip, "model = torch.nn.Linear(256, 128)")
    assert isinstance(r, MemoryReport) and r.backend == "cpu"
    assert r.breakdown_increment["parameters"] == P_LINEAR
    assert r.retained == P_LINEAR == r.increment
    assert sum(r.breakdown.values()) == r.peak


def test_gradients_and_adam_state_exact(ip):
    ip.run_cell("model = torch.nn.Linear(256, 128); x = torch.randn(32, 256)")
    r = gpumem(ip, "opt = torch.optim.Adam(model.parameters())\n"
                   "model(x).sum().backward()\nopt.step()")
    # exp_avg and exp_avg_sq: 2 x parameters; plus one 4-byte fp32 step counter per tensor
    assert r.breakdown_increment["optimizer_state"] == 2 * P_LINEAR + 2 * 4
    assert r.breakdown_increment["gradients"] == P_LINEAR
    assert r.breakdown_increment["parameters"] == 0  # made in an earlier cell: counted in before
    assert r.before >= P_LINEAR + 32 * 256 * 4
    assert r.retained == P_LINEAR + 2 * P_LINEAR + 8  # grads + Adam state stay
    assert sum(r.breakdown.values()) == r.peak


def test_saved_activation_of_known_shape(ip):
    r = gpumem(ip, "x = torch.randn(100, 50, requires_grad=True)\ny = x.exp()\nz = y.sum()")
    assert r.breakdown_increment["activations"] == 100 * 50 * 4  # exp saves its result
    assert r.breakdown_increment["other"] == 100 * 50 * 4 + 4  # x and the scalar z
    ip.run_cell("z.backward()")


def test_activations_of_an_earlier_graph_count_before(ip):
    base = gpumem(ip, "pass").breakdown_before["activations"]  # whatever else is alive
    ip.run_cell("x = torch.randn(100, 50, requires_grad=True)\ny = x.exp()\nz = y.sum()")
    r = gpumem(ip, "z.backward()")
    # y was saved by a graph made in an earlier cell: found through the graph, counted before
    assert r.breakdown_before["activations"] - base == 100 * 50 * 4
    assert r.retained == 100 * 50 * 4  # x.grad


def test_buffers_exact(ip):
    r = gpumem(ip, "bn = torch.nn.BatchNorm1d(100)")
    assert r.breakdown_increment["buffers"] == 100 * 4 * 2 + 8  # running mean/var + int64 counter
    assert r.breakdown_increment["parameters"] == 100 * 4 * 2


def test_existing_tensors_count_in_before_not_increment(ip):
    ip.run_cell("big = torch.zeros(1 << 20)")
    r = gpumem(ip, "small = torch.zeros(1000)")
    assert r.before >= 4 << 20
    assert r.increment == r.retained == 4000


def test_freeing_an_existing_tensor_shows_negative_retained(ip):
    ip.run_cell("big = torch.zeros(1 << 20)")
    r = gpumem(ip, "del big")
    assert r.retained == -(4 << 20)
    assert r.increment == 0


def test_temporaries_raise_the_peak_but_not_retained(ip):
    r = gpumem(ip, "a = torch.ones(1000)\nb = (a * 2 + 1).sum()")
    assert r.retained == 4000 + 4
    assert r.increment == 4000 + 4000 + 4000  # a, a*2 and (a*2)+1 live together


def test_line_magic_and_var_option(ip):
    ip.run_cell("%gpumem -q --backend cpu -v rep y = torch.ones(1000)")
    rep = ip.user_ns["rep"]
    assert isinstance(rep, MemoryReport) and rep.increment == 4000
    assert ip.user_ns["y"].shape == (1000,)


def test_last_expression_is_evaluated_in_the_namespace(ip, capsys):
    r = gpumem(ip, "t = torch.ones(10)\nt.sum()")
    assert r.retained >= 40


def test_auto_backend_without_gpu_says_what_it_picked(ip):
    if torch.cuda.is_available():
        pytest.skip("a GPU is usable: auto picks cuda")
    r = gpumem(ip, "a = torch.ones(10)", "-o -q")
    assert r.backend == "cpu"
    assert any("auto picked the cpu backend" in n for n in r.notes)


def test_quiet_prints_nothing_and_default_prints_the_report(ip, capsys):
    gpumem(ip, "a = torch.ones(10)")
    assert capsys.readouterr().out == ""
    ip.run_cell_magic("gpumem", "--backend cpu --no-chart", "a = torch.ones(10)")
    assert "<MemoryReport : peak" in capsys.readouterr().out


def test_nested_magics_keep_both_measurements_right(ip):
    outer = gpumem(ip, "a = torch.ones(1000)\n"
                       "%gpumem -q --backend cpu -v inner b = torch.ones(2000)\n"
                       "del b\nc = torch.ones(500)")
    inner = ip.user_ns["inner"]
    assert inner.increment == inner.retained == 8000
    assert outer.increment == 4000 + 8000  # a and b together
    assert outer.retained == 4000 + 2000


def test_nested_activations_seen_by_both(ip):
    outer = gpumem(ip, "x = torch.randn(100, 50, requires_grad=True)\n"
                       "%gpumem -q --backend cpu -v inner y = x.exp()\n"
                       "z = y.sum()")
    assert ip.user_ns["inner"].breakdown_increment["activations"] == 20000
    assert outer.breakdown_increment["activations"] == 20000


@pytest.mark.parametrize("line,expect", [
    ("--bogus", "unrecognized arguments"),
    ("--backend tpu", "invalid choice"),
    ("--backend cpu --gpu T4", "add --backend sim"),
    ("--backend cpu --device 1", "--backend cuda"),
    ("--backend sim --device 1", "--backend cuda"),
    ("--backend cpu -v 1x", "variable name"),
    ("--backend cpu --no-breakdown", "cuda only"),
])
def test_bad_arguments_are_one_line_usage_errors(ip, line, expect):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match=expect) as info:
        ip.run_cell_magic("gpumem", line, "x = 1")
    assert "\n" not in str(info.value)
    assert "x" not in ip.user_ns  # the cell did not run


def test_cuda_backend_without_gpu_is_a_usage_error(ip):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="--backend cpu"):
        ip.run_cell_magic("gpumem", "--backend cuda", "x = 1")


def test_syntax_error_in_the_cell_is_reported_like_any_cell(ip):
    res = ip.run_cell("%%gpumem --backend cpu -q\nx = (")
    assert isinstance(res.error_in_exec, SyntaxError)


def test_empty_cell_is_a_usage_error(ip):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="nothing to measure"):
        ip.run_cell_magic("gpumem", "", "   \n")


def test_exception_prints_report_then_reraises(ip, clean_state, capsys):
    res = ip.run_cell("%%gpumem --backend cpu -v rep --no-chart\n"
                      "keep = torch.ones(1000)\nraise ValueError('boom')")
    assert isinstance(res.error_in_exec, ValueError)
    out = capsys.readouterr().out
    assert "cell failed: ValueError: boom" in out
    rep = ip.user_ns["rep"]
    assert rep.error == "ValueError: boom"
    assert rep.retained == 4000
    assert ip.user_ns["keep"].numel() == 1000  # what ran before the failure stays


def test_keyboard_interrupt_leaves_no_state(ip, clean_state):
    res = ip.run_cell("%%gpumem --backend cpu -q -v rep\n"
                      "m = torch.nn.Linear(4, 4)\nraise KeyboardInterrupt")
    assert isinstance(res.error_in_exec, KeyboardInterrupt)
    assert ip.user_ns["rep"].error == "KeyboardInterrupt"


def test_exception_inside_forward_and_backward_leaves_no_state(ip, clean_state):
    cell = ("class Bad(torch.nn.Module):\n"
            "    def forward(self, x):\n"
            "        raise RuntimeError('inside forward')\n"
            "Bad()(torch.ones(2))\n")
    res = ip.run_cell("%%gpumem --backend cpu -q\n" + cell)
    assert isinstance(res.error_in_exec, RuntimeError)
    cell2 = ("class F(torch.autograd.Function):\n"
             "    @staticmethod\n"
             "    def forward(ctx, x): return x * 2\n"
             "    @staticmethod\n"
             "    def backward(ctx, g): raise RuntimeError('inside backward')\n"
             "F.apply(torch.ones(2, requires_grad=True)).sum().backward()\n")
    res = ip.run_cell("%%gpumem --backend cpu -q\n" + cell2)
    assert isinstance(res.error_in_exec, RuntimeError)
    # the shell still works normally
    r = gpumem(ip, "ok = torch.ones(3)")
    assert r.retained == 12


def test_out_of_memory_releases_the_failed_frames(ip, clean_state, capsys):
    ip.run_cell(
        "import weakref\n"
        "refs = []\n"
        "def step():\n"
        "    big = torch.ones(1 << 18)\n"
        "    refs.append(weakref.ref(big))\n"
        "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. ...')\n")
    res = ip.run_cell("%%gpumem --backend cpu --no-chart\nstep()")
    assert isinstance(res.error_in_exec, torch.OutOfMemoryError)
    err = capsys.readouterr().err
    assert "tried to allocate 2.00 GiB" in err and "were live" in err
    gc.collect()
    assert ip.user_ns["refs"][0]() is None  # the frame's tensor was released


def test_state_restored_after_successful_cell(ip, clean_state):
    gpumem(ip, "m = torch.nn.Linear(8, 8)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
               "m(torch.ones(2, 8)).sum().backward()\nopt.step()")


def _visible_frames(tb):
    """Files of the frames IPython shows (it hides those with __tracebackhide__)."""
    out = []
    while tb is not None:
        if not tb.tb_frame.f_locals.get("__tracebackhide__"):
            out.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return out


@pytest.mark.parametrize("opts,cell", [
    ("--backend cpu -q", "def f():\n    raise ValueError('deep')\nf()"),
    ("--backend sim -q --gpu-memory 64MiB", "x = torch.ones(1 << 25, device='cuda')"),
])
def test_tracebacks_show_the_users_code_not_memmagic(ip, opts, cell):
    import memmagic

    own = memmagic.__file__.rsplit("/", 1)[0]
    res = ip.run_cell(f"%%gpumem {opts}\n{cell}")
    assert res.error_in_exec is not None
    files = _visible_frames(res.error_in_exec.__traceback__)
    assert not any(f.startswith(own) for f in files), files
    assert sum(f.startswith("<ipython-input") for f in files) >= 2, files  # the cell's own lines


def test_the_doctors_re_runs_print_nothing_and_the_users_own_run_does(ip, clean_state, capsys):
    """After an out of memory the doctor re-runs the cell with each fix (and sharded over
    GPUs with --advise): what those runs print is not the user's output. The user's own
    run prints as always, also with a knob set (--batch-size goes through the what-if
    engine)."""
    ip.run_cell("batch_size = 1 << 16")
    cell = ("print('hello from the cell', batch_size)\n"
            "w = torch.nn.Linear(1024, 1024).cuda()\n"
            "w(torch.randn(batch_size, 1024, device='cuda')).sum().backward()\n")
    ip.run_cell("%%gpumem --backend sim --gpu-memory 256MiB --no-chart --advise\n" + cell)
    out = "".join(capsys.readouterr())
    printed = re.findall(r"hello from the cell (\d+)", out)  # the traceback shows the line too
    assert printed == ["65536"], out
    assert "strategies, by peak" in out and "batch " in out  # the re-runs ran
    ip.run_cell("%%gpumem --backend sim --no-chart -q --batch-size 4\n" + cell)
    assert "hello from the cell 4" in capsys.readouterr().out
