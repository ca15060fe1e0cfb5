"""%%gpumem options and misuse, through a real IPython InteractiveShell (issue 14, item 11)."""
from __future__ import annotations

import pytest
import torch
from IPython.core.error import UsageError

import memmagic
from memmagic import MemoryReport
from memmagic.backends.sim import SimulationUnsupported, resolve_target

NO_GPU = not torch.cuda.is_available()


def gpumem(ip, cell, opts="--backend cpu -o -q --no-chart"):
    return ip.run_cell_magic("gpumem", opts, cell)


# -- CUDA code on a machine without a GPU --------------------------------------------------
@pytest.mark.skipif(not NO_GPU, reason="a GPU is usable: CUDA code runs")
@pytest.mark.parametrize("opts", ["-q -v rep", "--backend cpu -q -v rep", "-v rep --no-chart"])
def test_cuda_code_without_a_gpu_says_use_the_sim_backend(ip, capsys, opts):
    res = ip.run_cell(f"%%gpumem {opts}\nx = torch.zeros(3, device='cuda')")
    error = res.error_in_exec
    assert isinstance(error, AssertionError)  # torch's own error, type kept
    assert "not compiled with CUDA" in str(error)
    hint, = [n for n in error.__notes__ if "--backend sim" in n]
    assert "\n" not in hint
    assert "--backend sim" in capsys.readouterr().out  # shown under the error
    assert any("--backend sim" in n for n in ip.user_ns["rep"].notes)


@pytest.mark.skipif(not NO_GPU, reason="a GPU is usable: CUDA code runs")
def test_the_hint_is_given_once_and_the_sim_backend_runs_the_cell(ip):
    res = ip.run_cell("%%gpumem -q\nx = torch.ones(3).cuda()")
    assert len(res.error_in_exec.__notes__) == 1
    r = gpumem(ip, "x = torch.zeros(3, device='cuda')", "--backend sim -o -q")
    assert r.error is None and r.peak == 512


def test_other_errors_get_no_hint(ip):
    res = ip.run_cell("%%gpumem --backend cpu -q\nraise RuntimeError('CUDA-free failure')")
    assert not getattr(res.error_in_exec, "__notes__", None)


# -- -o: the report is shown once ----------------------------------------------------------
def _shown_reports(ip, monkeypatch, source: str) -> int:
    """How many times running ``source`` showed a MemoryReport (display() or Out[])."""
    shown: list[dict] = []
    monkeypatch.setattr(ip.display_pub, "publish",
                        lambda data, metadata=None, **kw: shown.append(data))
    monkeypatch.setattr(ip.displayhook, "write_format_data",
                        lambda data, md=None: shown.append(data))
    ip.run_cell(source, store_history=True)
    monkeypatch.undo()
    return sum("<MemoryReport" in d.get("text/plain", "") for d in shown)


@pytest.mark.parametrize("opts", ["--backend cpu -o", "--backend cpu", "--backend sim -o"])
def test_the_report_is_shown_once(ip, monkeypatch, opts):
    assert _shown_reports(ip, monkeypatch, f"%%gpumem {opts}\na = torch.ones(10)") == 1


def test_o_returns_the_report_and_quiet_shows_none(ip, monkeypatch):
    source = "%%gpumem --backend cpu -o -q\na = torch.ones(10)"
    assert _shown_reports(ip, monkeypatch, source) == 1
    assert _shown_reports(ip, monkeypatch, "r = %gpumem --backend cpu -o -q a = torch.ones(10)") == 0
    assert isinstance(ip.user_ns["r"], MemoryReport)


def test_a_failed_cell_shows_its_report_even_with_o(ip, monkeypatch):
    assert _shown_reports(ip, monkeypatch, "%%gpumem --backend cpu -o\nraise KeyError('k')") == 1


# -- --gpu-memory: a unit, a sensible size -------------------------------------------------
@pytest.mark.parametrize("size", ["6", "6000", "1MiB", "0GiB"])
def test_gpu_memory_below_the_minimum_says_what_to_write(ip, size):
    with pytest.raises(UsageError) as info:
        gpumem(ip, "x = 1", f"--backend sim --gpu-memory {size}")
    msg = str(info.value)
    assert "\n" not in msg
    assert f"--gpu-memory {size} is" in msg and "--gpu-memory 6GiB" in msg
    assert "gpu_memory=" not in msg
    assert "x" not in ip.user_ns  # nothing ran


def test_gpu_memory_that_is_not_a_size(ip):
    with pytest.raises(UsageError, match="cannot read --gpu-memory lots as a card's size"):
        gpumem(ip, "x = 1", "--backend sim --gpu-memory lots")


def test_gpu_memory_with_a_unit_or_in_bytes(ip):
    r = gpumem(ip, "x = torch.ones(4, device='cuda')", "--backend sim -o -q --gpu-memory 6GiB")
    assert r.gpu_memory == 6 << 30 and r.gpu_name == "GPU with 6.00 GiB"
    r = gpumem(ip, "x = 1", f"--backend sim -o -q --gpu-memory {8 << 30}")
    assert r.gpu_memory == 8 << 30


def test_api_gpu_memory_int_below_the_minimum_is_an_error():
    with pytest.raises(ValueError, match=r"gpu_memory=6 is 6 B.*gpu_memory='6GiB'"):
        memmagic.measure(lambda: None, backend="sim", gpu_memory=6)
    with pytest.raises(ValueError, match=r"gpu_memory='6' is 6 B"):
        resolve_target(None, "6")
    assert resolve_target(None, 6 << 30).total_memory == 6 << 30


# -- --gpu with --gpu-memory: said, not silent ---------------------------------------------
def test_gpu_with_gpu_memory_names_both_and_says_so(ip):
    r = gpumem(ip, "x = torch.ones(4, device='cuda')",
               "--backend sim -o -q --gpu T4 --gpu-memory 6GiB")
    t4 = resolve_target("T4")
    assert r.gpu_name == "T4 with 6.00 GiB" and r.gpu_memory == 6 << 30
    assert "T4 with 6.00 GiB" in r.device
    note, = [n for n in r.notes if "replaced" in n]
    assert "--gpu-memory 6GiB" in note and "T4" in note and "14.74 GiB" in note
    target = resolve_target("T4", "6GiB")
    assert target.capability == t4.capability and target.resized_from == t4  # T4's kernels


def test_gpu_alone_and_gpu_memory_of_the_card_have_no_note(ip):
    r = gpumem(ip, "x = 1", "--backend sim -o -q --gpu T4")
    assert r.gpu_name == "T4" and not [n for n in r.notes if "replaced" in n]
    assert resolve_target("T4", resolve_target("T4").total_memory).name == "T4"


def test_help_says_what_gpu_memory_does_with_gpu(ip):
    doc = ip.find_cell_magic("gpumem").__doc__
    assert "--gpu T4 --gpu-memory 6GiB" in " ".join(doc.split())


# -- errors name the options as typed ------------------------------------------------------
def test_unknown_gpu_names_the_option(ip):
    with pytest.raises(UsageError) as info:
        gpumem(ip, "x = 1", "--backend sim --gpu GTX9999")
    msg = str(info.value)
    assert "unknown GPU 'GTX9999'" in msg and "--gpu-memory <size>" in msg
    assert "gpu_memory=" not in msg


def test_api_errors_name_the_keywords():
    with pytest.raises(ValueError, match=r"gpu_memory='<size>'"):
        memmagic.measure(lambda: None, backend="sim", gpu="GTX9999")


# -- syntax errors -------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["%%gpumem --backend cpu\nx = 1\ny = (\n",
                                    "%%gpumem --backend sim\nx = 1\nif True\n    pass\n",
                                    "%gpumem --backend cpu x = = 1"])
def test_syntax_error_shows_as_ipython_shows_one(ip, capsys, source):
    res = ip.run_cell(source)
    out = capsys.readouterr()
    text = out.out + out.err
    assert "SyntaxError" in text
    assert "magics.py" not in text and "Traceback" not in text and "memmagic" not in text
    assert isinstance(res.error_in_exec, SyntaxError) and not res.success  # Run All stops
    assert "x" not in ip.user_ns  # nothing ran


def test_syntax_error_points_at_the_cell_line(ip, capsys):
    ip.run_cell("%%gpumem --backend cpu\nx = 1\ny = (\n")
    text = capsys.readouterr().out
    assert "line 2" in text and "y = (" in text


# -- nested measurements -------------------------------------------------------------------
def test_nested_cpu_measure_keeps_the_outer_peak(ip):
    outer = gpumem(ip, "import memmagic\n"
                       "a = torch.ones(1000)\n"
                       "inner = memmagic.measure(lambda: torch.ones(2000).sum(), backend='cpu')\n"
                       "b = torch.ones(500)")
    inner = ip.user_ns["inner"]
    assert inner.increment == 8000 + 4  # the temporary and the sum
    assert outer.increment >= 4000 + 8000 + 4  # a with the inner temporaries
    assert outer.retained == 4000 + 2000


def test_nested_sim_measure_in_a_sim_cell_is_a_clear_error(ip):
    res = ip.run_cell("%%gpumem --backend sim -q\nimport memmagic\n"
                      "memmagic.measure(lambda: torch.ones(3, device='cuda'), backend='sim')")
    error = res.error_in_exec
    assert isinstance(error, SimulationUnsupported), repr(error)
    assert "cannot run inside another" in str(error) and "\n" not in str(error)
    assert not isinstance(error, AssertionError)


@pytest.mark.parametrize("inner", ["memmagic.measure(lambda: torch.ones(3), backend='cpu')",
                                   "memmagic.measure(lambda: torch.ones(3))",
                                   "get_ipython().run_line_magic('gpumem', "
                                   "'-q --backend cpu y = torch.ones(3)')"])
def test_a_real_measurement_in_a_sim_cell_is_a_clear_error(ip, inner):
    res = ip.run_cell(f"%%gpumem --backend sim -q\nimport memmagic\n{inner}")
    error = res.error_in_exec
    assert isinstance(error, SimulationUnsupported), repr(error)
    assert "cannot run inside a simulated one" in str(error) and "\n" not in str(error)
    r = gpumem(ip, "z = torch.ones(100)")  # the next real cell measures as usual
    assert r.increment == 400


def test_a_failed_start_raises_its_own_error_not_an_assertion(clean_state):
    from memmagic.backends import Backend

    class Broken(Backend):
        name = "broken"

        def measuring(self, roots=None):
            raise RuntimeError("cannot start")

    with pytest.raises(RuntimeError, match="cannot start"):
        Broken().measure(lambda: None)


# -- bad input gets one line that says what to do (issue 36, item 7) ------------------------
def _shown(ip, capsys, source: str):
    """(the cell's error, the lines IPython printed for it)."""
    res = ip.run_cell(source)
    out = capsys.readouterr()
    return res.error_in_exec, [ln for ln in (out.out + out.err).splitlines() if ln.strip()]


@pytest.mark.parametrize("source", ['%%gpumem --backend sim --gpu "T4\nx = 1',
                                    '%gpumem --backend cpu --gpu "T4 x = 1',
                                    '%gpusim on --gpu "T4'])
def test_an_open_quote_is_one_line(ip, capsys, source):
    error, lines = _shown(ip, capsys, source)
    assert isinstance(error, UsageError) and len(lines) == 1, lines
    assert "a quote is not closed: close it" in lines[0]
    assert "x" not in ip.user_ns and not ip._memmagic_sim_mode.on


def test_quoted_values_are_read_without_their_quotes(ip):
    r = gpumem(ip, "x = torch.ones(4, device='cuda')", '--backend sim -o -q --gpu "T4"')
    assert r.gpu_name == "T4"
    r = gpumem(ip, "x = 1", "--backend sim -o -q --gpu 'T4' --gpu-memory \"6GiB\"")
    assert r.gpu_name == "T4 with 6.00 GiB"


@pytest.mark.parametrize("line", ["--backend sim --gpu-memory 99999999999999TiB",
                                  "--backend sim --gpu T4 --gpu-memory 16TB"])
def test_gpu_memory_above_the_largest_card_is_one_line(ip, capsys, line):
    error, lines = _shown(ip, capsys, f"%%gpumem {line}\nx = 1")
    assert isinstance(error, UsageError) and len(lines) == 1, lines
    assert "above the largest card simulated (4.00 TiB)" in lines[0]
    assert "like --gpu-memory 6GiB" in lines[0] and "x" not in ip.user_ns
    error, lines = _shown(ip, capsys, "%gpusim on --gpu-memory 99999999999999TiB")
    assert isinstance(error, UsageError) and len(lines) == 1 and "4.00 TiB" in lines[0]
    assert not ip._memmagic_sim_mode.on


def test_api_gpu_memory_above_the_largest_card_is_an_error():
    with pytest.raises(ValueError, match=r"gpu_memory='5TiB' is 5.00 TiB, above the largest"):
        resolve_target(None, "5TiB")
    assert resolve_target(None, "4TiB").total_memory == 4 << 40


@pytest.mark.parametrize("value", ['""', "''", '"  "'])
def test_an_empty_card_name_says_to_name_one(ip, capsys, value):
    for source, no_card in ((f"%%gpumem --backend sim --gpu {value}\nx = 1", "leave --gpu out"),
                            (f"%gpusim on --gpu {value}", "--gpu none")):
        error, lines = _shown(ip, capsys, source)
        assert isinstance(error, UsageError) and len(lines) == 1, lines
        assert "--gpu needs a card name" in lines[0] and "A100-80GB" in lines[0]
        assert no_card in lines[0]
    error, lines = _shown(ip, capsys, f"%%gpumem --backend sim --gpu-memory {value}\nx = 1")
    assert isinstance(error, UsageError) and len(lines) == 1, lines
    assert "--gpu-memory needs a size with a unit" in lines[0]
    assert "x" not in ip.user_ns and not ip._memmagic_sim_mode.on


def test_an_empty_card_under_gpusim_is_not_the_notebooks_card(ip):
    ip.run_line_magic("gpusim", "on --gpu T4")
    try:
        with pytest.raises(UsageError, match="--gpu needs a card name"):
            gpumem(ip, "x = 1", '-o -q --gpu ""')
    finally:
        ip.run_line_magic("gpusim", "off")
    assert "x" not in ip.user_ns


@pytest.mark.parametrize("line, says", [
    ("--whatif --sweep batch_size=1:4", "--whatif and --sweep are two views of the cell"),
    ("--sweep batch_size=1:4 --range batch_size=1:8", "add --whatif"),
])
def test_options_that_do_not_go_together_are_one_line(ip, capsys, line, says):
    ip.user_ns["batch_size"] = 2
    error, lines = _shown(ip, capsys, f"%%gpumem {line}\nx = torch.ones(batch_size)")
    assert isinstance(error, UsageError) and len(lines) == 1, lines
    assert says in lines[0] and "x" not in ip.user_ns


# -- a tensor whose sizes overflow, on the simulated GPU ---------------------------------------
@pytest.mark.parametrize("code, cuda", [
    ("x = torch.randn(10**12, 10**12, device='cuda')",
     "Storage size calculation overflowed with sizes=[1000000000000, 1000000000000]"),
    ("x = torch.zeros(10**12, 10**12)",
     "Storage size calculation overflowed with sizes=[1000000000000, 1000000000000]"),
    ("x = torch.ones(1, device='cuda').expand(10**12, 10**12)",
     "numel: integer multiplication overflow"),
])
def test_sizes_past_64_bits_fail_as_on_a_gpu_in_a_short_traceback(ip, capsys, clean_state, code, cuda):
    from memmagic.backends.sim import SimulatedSizeError
    from memmagic.backends.sim.session import shell_session

    ip.run_cell_magic("gpumem", "--backend sim -q", "kept = torch.ones(256, device='cuda')")
    held = shell_session(ip).status()
    error, lines = _shown(ip, capsys, f"%%gpumem --backend sim -q\n{code}")
    # RuntimeError, as torch raises it on a GPU; CUDA's words, the line, what to do
    assert isinstance(error, SimulatedSizeError) and isinstance(error, RuntimeError)
    message = str(error)
    assert "\n" not in message and cuda in message and "check them" in message
    assert message.startswith("line 1 (`x = ") and error.op
    text = "\n".join(lines)
    assert "fake_tensor" not in text and "_subclasses" not in text and "memmagic/" not in text
    assert len(lines) <= 10, text  # IPython's frame for the magic, the cell's line, the error
    assert shell_session(ip).status() == held and "x" not in ip.user_ns  # the card as it was


def test_an_op_error_on_fake_tensors_shows_the_users_line_not_the_dispatch(ip, capsys):
    error, lines = _shown(ip, capsys, "%%gpumem --backend sim -q\n"
                                      "a = torch.ones(3, 4, device='cuda')\n"
                                      "b = a @ torch.ones(5, 6, device='cuda')")
    assert isinstance(error, RuntimeError) and "cannot be multiplied" in str(error)
    text = "\n".join(lines)
    assert "b = a @ torch.ones(5, 6" in text
    assert "fake_tensor" not in text and "torch/_ops.py" not in text and len(lines) <= 10, text


def test_fake_tensors_log_nothing_of_an_op_error_they_raise(ip):
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    records: list = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        result = ip.run_cell("%%gpumem --backend sim -q\n"
                             "m = torch.nn.Linear(4, 4).cuda()\n"
                             "y = m(torch.randn(2, 5, device='cuda'))")
    finally:
        logger.removeHandler(handler)
    assert isinstance(result.error_in_exec, RuntimeError)
    assert records == [] and not logger.disabled  # muted for the run only
