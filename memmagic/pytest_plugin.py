"""memmagic's pytest plugin (registered through the ``pytest11`` entry point): the
``memory_budget`` marker and fixture of :mod:`memmagic.budget`.

    @pytest.mark.memory_budget("2GiB", gpu="T4")
    def test_train_step_fits(): ...

runs the test's body on a fresh simulated GPU and fails it when the body needs more than
the budget, or does not fit the card; the failure holds the report. Fixtures are made
before, outside the simulation (real objects: move them to "cuda" in the test).
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
        raise pytest.UsageError("memory_budget takes one positional argument, the budget; "
                                "name the card with gpu='T4'")
    test = pyfuncitem.obj

    @functools.wraps(test)
    def on_the_simulated_gpu(*args: Any, **kwargs: Any) -> None:
        __tracebackhide__ = True
        body = functools.wraps(test)(lambda: test(*args, **kwargs))
        pyfuncitem.user_properties.append(("memory_budget", check_budget(body, budget, **options)))

    pyfuncitem.obj = on_the_simulated_gpu
    try:
        __tracebackhide__ = True
        return (yield)
    finally:
        pyfuncitem.obj = test


@pytest.fixture
def memory_budget() -> Callable[..., Any]:
    """:func:`memmagic.budget.check_budget`: ``memory_budget(fn, "2GiB", gpu="T4")``."""
    from .budget import check_budget

    return check_budget
