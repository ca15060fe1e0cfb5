"""A job's ranks, each run: ``--ranks all|R,R`` of the command line and of ``%%gpumem``.

Ranks of one job differ (the rank that gathers a full state dict, uneven shards, the rank
that holds the loss), and the job fits only where every rank fits. :func:`run_job` runs
the cell or script once per rank named (the doctor idle), and returns the report of the
rank that decides: one that failed, else one that ran out of memory, else the one that
needs the most of its card, with every rank's figures in :attr:`MemoryReport.job`. After an
out of memory that rank runs again with the doctor, which ranks its fixes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Mapping

from .core.interrupts import is_interrupt
from .pipeline import CellRequest, CellResult, run_cell
from .report import JobRanks, MemoryReport, RankRow

__all__ = ["MAX_ALL_RANKS", "job_ranks", "parse_ranks", "run_job"]

# --ranks all runs the cell once per rank: up to this many
MAX_ALL_RANKS = 64

# how a rank ended, in the order that decides a job: ran, ran out of memory, failed
_RAN, _OUT_OF_MEMORY, _FAILED = 0, 1, 2


def job_ranks(world_size: int | None, rank: int | None, ranks: str | None) -> list[int] | None:
    """The ranks ``--rank`` / ``--ranks`` ask to run as, checked (None: one run, as rank
    ``rank`` or 0); ValueError in one line that says what to change."""
    if rank is not None and world_size is None:
        raise ValueError("--rank R needs --world-size N: the job whose rank R to run as")
    return None if ranks is None else parse_ranks(ranks, world_size, rank)


def parse_ranks(spec: str, world_size: int | None, rank: int | None = None) -> list[int]:
    """The ranks ``--ranks`` names, sorted (ValueError in one line for a job or a rank that
    is not there, and for ``--rank`` given too)."""
    n = world_size
    if n is None:
        raise ValueError("--ranks needs --world-size N: the job whose ranks to run as")
    if rank is not None:
        raise ValueError("give --rank R (one rank) or --ranks (several), not both")
    if spec.strip() == "all":
        if n > MAX_ALL_RANKS:
            raise ValueError(f"--ranks all runs once per rank: with {n} ranks, name the ones "
                             f"to run (--ranks 0,1,{n - 1})")
        return list(range(n))
    try:
        ranks = sorted({int(r) for r in spec.split(",") if r.strip()})
    except ValueError:
        ranks = []
    if not ranks or not all(0 <= r < n for r in ranks):
        raise ValueError(f"--ranks takes all or ranks of the job, 0 to {n - 1}, separated by "
                         f"commas (--ranks 0,{n - 1}), not {spec!r}")
    return ranks


def _demand(report: MemoryReport) -> tuple[int, int]:
    """How much a rank needs: one that failed first (the job fails with it), then one that
    ran out of memory (the live bytes and the request that failed), then what it needs of
    the card."""
    if report.failed_request is not None:
        return _OUT_OF_MEMORY, (report.live_at_failure or report.peak) + report.failed_request
    if report.error is not None:
        return _FAILED, report.card_need
    return _RAN, report.card_need


def run_job(request: CellRequest, ranks: list[int] | None = None, *,
            fresh: Callable[[], Mapping[str, Any]] | None = None,
            on_rank: Callable[[int, MemoryReport], None] | None = None) -> CellResult:
    """Run ``request`` as each of ``ranks`` of its ``world_size`` (None: once, as it is)
    and return the deciding rank's result, its report carrying every rank's figures.
    ``fresh`` gives the namespace each run starts from (a script's; the notebook's cell runs
    in its own namespace, whose names a rank's run leaves as they were); ``on_rank`` is told
    of each rank as it ends. A Ctrl-C stops the job at the rank it interrupted."""
    from .backends.sim import waits_for_a_stage

    start = fresh or (lambda: request.namespace)
    if ranks is None:
        return run_cell(replace(request, namespace=start()))
    results: dict[int, CellResult] = {}
    # pipeline stages: each rank hands the later stages the shapes of what it sends them
    mailbox: dict = {}
    request = replace(request, mailbox=mailbox)
    pending = list(ranks)
    while pending:  # a rank whose stage waited for a later rank's runs again after it
        waiting, sent = [], len(mailbox)
        for r in pending:
            results[r] = result = run_cell(replace(request, namespace=start(), rank=r,
                                                   rank_fixes=False))
            if is_interrupt(result.error):
                return result
            if waits_for_a_stage(result.error):
                waiting.append(r)
            elif on_rank is not None:
                on_rank(r, result.report)
        pending = waiting if len(mailbox) > sent else []
    for r in waiting:
        if on_rank is not None:
            on_rank(r, results[r].report)
    worst = max(results, key=lambda r: _demand(results[r].report))
    final = results[worst]
    if final.out_of_memory and request.rank_fixes:  # its fixes, ranked by the doctor
        final = run_cell(replace(request, namespace=start(), rank=worst))
    job = JobRanks(request.world_size, tuple(RankRow.of(r, res.report)
                                             for r, res in results.items()), worst)
    final.report = replace(final.report, job=job)
    return final
