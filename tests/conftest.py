from __future__ import annotations

import gc
import signal
import sys
from pathlib import Path

import pytest
import torch

# Packages installed for the tests' own process only (.ci/run: pip install --target), on the
# path before any test imports transformers. torchao is one: when it can be imported,
# transformers imports it with every model, and on a machine without CUDA its import logs
# warnings to stderr, which nbval would compare in the course notebooks' transformers cells
# (their kernels run without this directory, as on a student's machine without torchao).
_TEST_ONLY = Path(sys.prefix) / "test-only"
if _TEST_ONLY.is_dir() and str(_TEST_ONLY) not in sys.path:
    sys.path.append(str(_TEST_ONLY))


@pytest.fixture(scope="session")
def _shell():
    """The one IPython shell of this test process (IPython allows a single instance)."""
    from IPython.core.interactiveshell import InteractiveShell

    if InteractiveShell.initialized():
        return InteractiveShell.instance()
    from IPython.testing.globalipapp import start_ipython

    return start_ipython()


@pytest.fixture
def ip(_shell):
    """A real IPython InteractiveShell with memmagic loaded and a clean namespace."""
    _shell.run_line_magic("load_ext", "memmagic")
    _shell.run_cell("import torch")
    yield _shell
    _shell.run_line_magic("unload_ext", "memmagic")
    _shell.reset(new_session=False)
    # the notebook's simulated GPU lasts the shell's life: each test starts with an empty one
    session = getattr(_shell, "_memmagic_sim_session", None)
    if session is not None:
        session.reset()
    gc.collect()


def global_state() -> dict:
    """Every piece of global torch state memmagic could touch."""
    from memmagic.core import _torch_private as priv

    return {
        "dispatch_modes": priv.dispatch_mode_depth(),
        "function_mode": priv.function_mode_enabled(),
        "saved_tensor_hooks": priv.saved_tensors_hooks_top(),
        "module_hooks": priv.global_module_hook_counts(),
        "optimizer_hooks": priv.global_optimizer_hook_counts(),
        "autocast_cpu": torch.is_autocast_enabled("cpu"),
        "autocast_cuda": torch.is_autocast_enabled("cuda"),
        "default_device": str(torch.get_default_device()),
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
        "sigint_handler": signal.getsignal(signal.SIGINT),  # memmagic.core.interrupts' guard
        "trace_function": sys.gettrace(),
    }


@pytest.fixture
def clean_state():
    """Asserts the test leaves torch's global state exactly as it found it."""
    before = global_state()
    yield before
    assert global_state() == before


def _cpu_runs_bf16_lstm() -> bool:
    """Whether this CPU's oneDNN has a bf16 LSTM (CPUs without AVX-512 often have none:
    torch raises 'could not create a primitive descriptor for the LSTM forward ...')."""
    lstm = torch.nn.LSTM(4, 4)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lstm(torch.randn(2, 1, 4))
    except RuntimeError:
        return False
    return True


CPU_BF16_LSTM = _cpu_runs_bf16_lstm()


def skip_without_bf16_lstm(needed: bool = True) -> None:
    """Skip a test that runs a bf16 LSTM for real on a CPU that cannot."""
    if needed and not CPU_BF16_LSTM:
        pytest.skip("this CPU's oneDNN has no bf16 LSTM kernel (a real bf16 LSTM step "
                    "raises here, with or without memmagic)")


def pytest_collection_finish(session):
    """Collecting no tests is a failure, never a silent green run."""
    if not session.items:
        raise pytest.UsageError("no tests were collected: check testpaths in pyproject.toml")


# The browser tests' fixture notebook is opened by tests/frontends/test_browser.py in a real browser;
# nbval must not collect it (its outputs are not stored).
collect_ignore = ["browser"]
