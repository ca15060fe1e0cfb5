"""torch.compile'd code in a measured cell: measured eagerly, said so, and no lasting effect
(a later real call compiles as usual)."""
from __future__ import annotations

import types

import pytest
import torch

import memmagic
from memmagic.backends.sim import SimBackend
from memmagic.core.tracking import EagerCompiled


class CountingBackend:
    """A torch.compile backend that counts its compilations and runs the graph as traced."""

    def __init__(self) -> None:
        self.compiled = 0
        self.graph_calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.compiled += 1

        def run(*args):
            self.graph_calls += 1
            return gm.forward(*args)

        return run


def _fn(x):
    return (x * 2 + 1).relu().sum()


def _fresh():
    """``_fn`` with a code object of its own: dynamo's cache (per code object) starts empty,
    whatever earlier tests compiled (no torch._dynamo.reset(), which resets the session)."""
    return types.FunctionType(_fn.__code__.replace(), globals(), "fn")


def _compiled_note(report) -> list[str]:
    return [n for n in report.notes if "torch.compile" in n]


def _check_compiles_later(backend: CountingBackend, fn, x) -> None:
    """A real call after the measurement compiles (the backend runs) and runs the graph."""
    before = backend.compiled
    assert fn(x).item() == _fn(x).item()
    assert backend.compiled == before + 1
    assert backend.graph_calls >= 1


@pytest.mark.parametrize("name", ["cpu", "sim"])
def test_compiled_function_measured_eagerly_then_compiles_for_real(clean_state, name):
    backend = CountingBackend()
    fn = torch.compile(_fresh(), backend=backend)
    x = torch.randn(64, 64)
    device = "cuda" if name == "sim" else "cpu"  # the sim's device is a simulated GPU
    r = memmagic.measure(lambda: fn(torch.ones(64, 64, device=device)), backend=name)
    assert backend.compiled == 0  # ran eagerly under the measurement
    note, = _compiled_note(r)
    assert "eagerly" in note and "1 call" in note and "upper bound" in note
    assert r.peak > r.before  # the eager path's temporaries were seen
    _check_compiles_later(backend, fn, x)


def test_sim_execute_with_a_compiled_module_leaves_dynamo_usable(clean_state):
    backend = CountingBackend()
    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()),
                          backend=backend)
    out = SimBackend(gpu="T4").execute(
        lambda ns: exec("m = model.cuda()\nfor _ in range(3):\n"
                        "    y = m(torch.ones(4, 16, device='cuda'))", ns),
        {"model": model, "torch": torch})
    assert out.error is None
    assert backend.compiled == 0
    note, = _compiled_note(out.report)
    assert "3 calls" in note
    y = model(torch.ones(4, 16))  # a real call afterwards: compiled, frame counters move
    assert backend.compiled == 1 and y.shape == (4, 16)
    from torch._dynamo.utils import counters

    assert counters["frames"]["ok"] >= 1


def test_code_compiled_before_the_cell_keeps_its_graph(clean_state):
    backend = CountingBackend()
    fn = torch.compile(_fresh(), backend=backend)
    x = torch.randn(8, 8)
    fn(x)
    assert backend.compiled == 1
    r = memmagic.measure(lambda: fn(x), backend="cpu")
    assert backend.compiled == 1 and _compiled_note(r)
    calls = backend.graph_calls
    fn(x)  # the cached graph still runs: no recompilation
    assert backend.compiled == 1 and backend.graph_calls == calls + 1


def test_compiled_code_in_a_magic_cell(ip):
    backend = CountingBackend()
    ip.user_ns["counting"] = backend
    ip.run_cell("import torch\ndef g(x):\n    return (x * 3).sum()\n"
                "cg = torch.compile(g, backend=counting)")
    r = ip.run_cell_magic("gpumem", "--backend cpu -o -q --no-chart", "y = cg(torch.ones(100))")
    assert backend.compiled == 0 and _compiled_note(r)
    ip.run_cell("z = cg(torch.ones(100))")
    assert backend.compiled == 1


def test_no_note_without_compiled_code(clean_state):
    for name in ("cpu", "sim"):
        r = memmagic.measure(lambda: _fn(torch.ones(8, 8)), backend=name)
        assert _compiled_note(r) == []


@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
def test_stance_restored_after_an_error(clean_state, exc):
    import torch._dynamo.eval_frame as eval_frame

    backend = CountingBackend()
    fn = torch.compile(_fresh(), backend=backend)
    original = eval_frame._callback_from_stance

    def boom():
        fn(torch.ones(4))
        raise exc("stop")

    with pytest.raises(exc):
        memmagic.measure(boom, backend="cpu")
    assert eval_frame._stance.stance == "default"
    assert eval_frame._callback_from_stance is original
    _check_compiles_later(backend, fn, torch.ones(4))


def test_eager_compiled_nests():
    import torch._dynamo.eval_frame as eval_frame

    original = eval_frame._callback_from_stance
    fn = torch.compile(_fresh(), backend=CountingBackend())
    outer, inner = EagerCompiled(), EagerCompiled()
    outer.install()
    try:
        fn(torch.ones(2))
        inner.install()
        try:
            fn(torch.ones(2))
        finally:
            inner.uninstall()
        assert eval_frame._stance.stance == "force_eager"
    finally:
        outer.uninstall()
    assert (outer.calls, inner.calls) == (2, 1)
    assert eval_frame._stance.stance == "default" and eval_frame._callback_from_stance is original


def test_compiled_module_named_as_its_module_and_no_hook_warning(clean_state):
    import warnings

    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.ReLU())
    compiled = torch.compile(model, backend=CountingBackend())
    x = torch.randn(10, 100)
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plain = memmagic.measure(lambda: model(x), backend="cpu")
        r = memmagic.measure(lambda: compiled(x), backend="cpu")
    assert not [w for w in seen if "global hooks" in str(w.message)]
    assert r.peak_module == plain.peak_module == "Sequential.1"
    assert warnings.filters == filters


def test_a_warning_filter_the_cell_adds_stays(clean_state):
    import warnings

    fn = torch.compile(_fresh(), backend=CountingBackend())
    with warnings.catch_warnings():
        def cell():
            fn(torch.ones(3))
            warnings.filterwarnings("ignore", message="added by the cell")

        memmagic.measure(cell, backend="cpu")
        assert warnings.filters[0][1].pattern == "added by the cell"


def test_a_compiled_models_modules_in_a_module_list_are_named_by_their_paths(ip):
    """``model = torch.compile(model)`` as nanoGPT writes it: the per-module rows and the
    peak's module read as attribute paths (``model.blocks.1.mlp.2``), never by a class name
    (``model.Block.mlp``), the same as without the wrapper."""
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell(
        "class Block(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.mlp = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(),\n"
        "                                       torch.nn.Linear(512, 64))\n"
        "    def forward(self, x):\n"
        "        return x + self.mlp(x)\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))\n"
        "    def forward(self, x):\n"
        "        for b in self.blocks:\n"
        "            x = b(x)\n"
        "        return x\n"
        "model = Net().cuda()\n"
        "x = torch.randn(256, 64, device='cuda')\n")
    step = "model(x).sum().backward()"
    try:
        plain = ip.run_cell(f"%%gpumem -o -q --no-chart\n{step}").result
        ip.run_cell("model = torch.compile(model)")
        compiled = ip.run_cell(f"%%gpumem -o -q --no-chart\n{step}").result
    finally:
        ip.run_line_magic("gpusim", "off")
    assert compiled.peak_module == plain.peak_module
    assert compiled.peak_module.startswith("model.blocks.")
    rows = [r.module for r in compiled.modules]
    assert sorted(rows) == sorted(r.module for r in plain.modules) and "model.blocks.1.mlp.2" in rows
    assert all("Block" not in m for m in rows)
