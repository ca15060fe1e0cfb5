"""memmagic's pytest plugin (registered through the ``pytest11`` entry point): the
``memory_budget`` marker and fixture of :mod:`memmagic.frontends.budget`.

    @pytest.mark.memory_budget("2GiB", gpu="T4")
    def test_train_step_fits(): ...

runs the test's body on a fresh simulated GPU and fails it when the body needs more than
the budget, or does not fit the card; the failure holds the report. Fixtures are made
before, outside the simulation (real objects: move them to "cuda" in the test); a fixture
that makes CUDA tensors on a machine without a GPU fails saying so. A marker that cannot
run (an unknown card, a budget that is not a size) fails its test in one line.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest

_MARKER = ("memory_budget(budget=None, gpu=None, **options): run the test on memmagic's "
           "simulated GPU and fail it when it needs more than budget (bytes or '2GiB') or "
           "does not fit the card gpu")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _MARKER)


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    marker = pyfuncitem.get_closest_marker("memory_budget")
    if marker is None:
        return (yield)
    from .budget import check_budget

    budget = marker.args[0] if marker.args else marker.kwargs.get("budget")
    options = {k: v for k, v in marker.kwargs.items() if k != "budget"}
    if len(marker.args) > 1:
        pytest.fail("memory_budget takes one positional argument, the budget; name the card "
                    "with gpu='T4'", pytrace=False)
    test = pyfuncitem.obj

    @functools.wraps(test)
    def on_the_simulated_gpu(*args: Any, **kwargs: Any) -> None:
        __tracebackhide__ = True
        started = []

        @functools.wraps(test)
        def body() -> Any:
            started.append(True)
            return test(*args, **kwargs)

        try:
            report = check_budget(body, budget, **options)
        except (ValueError, TypeError) as exc:
            if started:  # the test's own error
                raise
            # the marker's: an unknown card, a budget that is not a size, an unknown option
            problem = f"memory_budget: {exc}"
        else:
            pyfuncitem.user_properties.append(("memory_budget", report))
            return
        __tracebackhide__ = False  # a frame to show, else pytest adds "all entries are hidden"
        pytest.fail(problem, pytrace=False)  # out of the except: no chained traceback

    pyfuncitem.obj = on_the_simulated_gpu
    try:
        __tracebackhide__ = True
        return (yield)
    finally:
        pyfuncitem.obj = test


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    """A fixture of a budget test that makes CUDA tensors where there is no GPU: one line
    that says fixtures run outside the simulation, and what to do."""
    from ..core.failures import needs_missing_cuda

    try:
        return (yield)
    except Exception as exc:
        budgeted = (item.get_closest_marker("memory_budget") is not None
                    or "memory_budget" in getattr(item, "fixturenames", ()))
        if not budgeted or not needs_missing_cuda(exc):
            raise
        problem = _fixture_needs_cuda(exc)
    pytest.fail(problem, pytrace=False)  # out of the except: no chained traceback


def _fixture_needs_cuda(error: BaseException) -> str:
    import os
    import traceback

    from ..core.failures import is_user_file

    where = ""
    for fs in traceback.extract_tb(error.__traceback__):
        if is_user_file(fs.filename):
            where = f" at {os.path.basename(fs.filename)}:{fs.lineno} in {fs.name}"
    return (f"memory_budget: a fixture needs a GPU{where} ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[0]}): fixtures run before the test, outside the "
            "simulated GPU; make the CUDA tensors in the test itself (a fixture can return CPU "
            "tensors for the test to move with .cuda(), or a function that makes them)")


@pytest.fixture
def memory_budget() -> Callable[..., Any]:
    """:func:`memmagic.frontends.budget.check_budget`: ``memory_budget(fn, "2GiB", gpu="T4")``."""
    from .budget import check_budget

    return check_budget
