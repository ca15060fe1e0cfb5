"""Memory budgets as tests: run a function on a fresh simulated GPU and
fail when it needs more than its budget, with the report in the failure. Fast enough for
every commit of a CPU-only CI: the simulation runs on fake tensors.

    from memmagic import check_budget
    check_budget(train_step, "2GiB", gpu="T4")

In pytest (the plugin in :mod:`memmagic.frontends.pytest_plugin` is registered on install)::

    @pytest.mark.memory_budget("2GiB", gpu="T4")
    def test_train_step_fits():
        train_step()            # written for a GPU: device="cuda"

or the ``memory_budget`` fixture, ``memory_budget(train_step, "2GiB", gpu="T4")``.
"""

from __future__ import annotations

from typing import Any, Callable

from ..backends.sim import SimulatedOutOfMemoryError, resolve_target
from ..report import MemoryReport, format_bytes, parse_bytes

__all__ = ["BudgetExceeded", "check_budget"]


class BudgetExceeded(AssertionError):
    """A function needed more memory than its budget (or ran out of the card); ``report`` is
    its :class:`MemoryReport`. An AssertionError, so a test that calls
    :func:`check_budget` fails, not errors."""

    def __init__(self, message: str, report: MemoryReport) -> None:
        super().__init__(message)
        self.report = report


def check_budget(fn: Callable[[], Any], budget: int | str | None = None, *,
                 gpu: str | None = None, **options: Any) -> MemoryReport:
    """Run ``fn()`` on a fresh simulated GPU and return its report, or raise
    :class:`BudgetExceeded` when it needs more than ``budget`` (bytes or ``"2GiB"``: the
    allocator's reserved peak, ``MemoryReport.need``) or does not fit the card ``gpu``
    (with the CUDA context: ``MemoryReport.fits``). ``budget`` None checks the card alone.
    ``options`` go to the simulated backend (``gpu_memory=``, ``kernels=``...). Other
    exceptions of ``fn`` propagate, with the report attached (``exc.memmagic_report``)."""
    from ..api import measure

    __tracebackhide__ = True  # pytest shows the test's line and the message, not this
    if budget is None and gpu is None and "gpu_memory" not in options:
        raise ValueError("check_budget needs a budget (bytes or '2GiB') or a card (gpu='T4')")
    limit = parse_bytes(budget) if isinstance(budget, str) else budget
    if limit is not None and (not isinstance(limit, int) or limit <= 0):
        raise ValueError(f"budget must be a positive size like '2GiB', not {budget!r}")
    try:  # the card first: its error from here, in one line, not from the backend's depths
        resolve_target(gpu, options.get("gpu_memory"))
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    name = getattr(fn, "__name__", None) or repr(fn)
    try:
        report = measure(fn, backend="sim", gpu=gpu, **options)
    except SimulatedOutOfMemoryError as exc:
        report = exc.memmagic_report  # type: ignore[attr-defined]
        raise BudgetExceeded(f"{name} ran out of memory on the simulated "
                             f"{report.gpu_name or 'GPU'}: {exc}\n{report.summary()}",
                             report) from None
    over = []
    if limit is not None and report.need > limit:
        over.append(f"needs {format_bytes(report.need)} (reserved peak), "
                    f"{format_bytes(report.need - limit)} over its budget of {format_bytes(limit)}")
    if report.fits is False:
        over.append(f"does not fit {report.gpu_name} ({format_bytes(report.gpu_memory)}): it "
                    f"needs {format_bytes(report.card_need)} of the card")
    if over:
        raise BudgetExceeded(f"{name} " + "; ".join(over) + "\n" + report.summary(), report)
    return report
