"""A job's ranks, each run: ``--ranks all|R,R`` of the command line and of ``%%gpumem``.

Ranks of one job differ (the rank that gathers a full state dict, uneven shards, the rank
that holds the loss), and the job fits only where every rank fits. :func:`run_job` runs
the cell or script once per rank named (the doctor idle), and returns the report of the
rank that decides: one that failed, else one that ran out of memory, else the one that
needs the most of its card, with every rank's figures in :attr:`MemoryReport.job`. After an
out of memory that rank runs again with the doctor, which ranks its fixes.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable, Mapping

from .core.interrupts import is_interrupt
from .pipeline import CellRequest, CellResult, run_cell
from .report import JobRanks, MemoryReport, RankRow

__all__ = ["MAX_ALL_RANKS", "gather_ranks", "job_ranks", "parse_ranks", "run_job",
           "torchrun_rank"]

# --ranks all runs the cell once per rank: up to this many
MAX_ALL_RANKS = 64

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


def run_job(request: CellRequest, ranks: list[int] | None = None, *,
            fresh: Callable[[], Mapping[str, Any]] | None = None,
            on_rank: Callable[[RankRow, MemoryReport], None] | None = None) -> CellResult:
    """Run ``request`` as each of ``ranks`` of its ``world_size`` (None: once, as it is)
    and return the deciding rank's result, its report carrying every rank's figures.
    ``fresh`` gives the namespace each run starts from (a script's; the notebook's cell runs
    in its own namespace, whose names a rank's run leaves as they were); ``on_rank`` is told
    of each rank as it ends (its row and its report). A Ctrl-C stops the job at the rank it
    interrupted."""
    from .backends.sim import waits_for_a_stage

    start = fresh or (lambda: request.namespace)
    if ranks is None:
        return run_cell(replace(request, namespace=start()))
    results: dict[int, CellResult] = {}
    rows: dict[int, RankRow] = {}

    def ended(r: int) -> None:
        rows[r] = RankRow.of(r, results[r].report)  # (replays the run's trace: once)
        if on_rank is not None:
            on_rank(rows[r], results[r].report)

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
            else:
                ended(r)
        pending = waiting if len(mailbox) > sent else []
    for r in waiting:
        ended(r)
    job_rows = tuple(rows[r] for r in results)  # in the order the ranks first ran
    worst = max(job_rows, key=lambda row: row.demand).rank
    final = results[worst]
    if final.out_of_memory and request.rank_fixes:  # its fixes, ranked by the doctor
        final = run_cell(replace(request, namespace=start(), rank=worst))
    final.report = replace(final.report, job=JobRanks(request.world_size, job_rows, worst))
    return final


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) of this process when torchrun started it, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


# how long a rank waits for the others' rows before it shows its own report alone
GATHER_TIMEOUT_S = 120


def gather_ranks(report: MemoryReport, rank: int, world_size: int) -> MemoryReport:
    """Rank 0's ``report`` with every rank's row of the real job this process is ``rank``
    of (started by torchrun, each rank measuring its own run), gathered over the job's
    process group: the script's own where it left it up, else a gloo group made from
    torchrun's environment for this; either ends after. Every rank calls it (a collective);
    the other ranks' reports come back as they were. A gather that fails or times out
    leaves a note instead."""
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=GATHER_TIMEOUT_S)
    rows: list | None = [None] * world_size if rank == 0 else None
    try:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timeout)
        try:  # rows travel over gloo, whatever the script's backend (NCCL's need devices)
            group = (None if dist.get_backend() == "gloo"
                     else dist.new_group(backend="gloo", timeout=timeout))
            dist.gather_object(RankRow.of(rank, report), rows, dst=0, group=group)
        finally:
            # the script has ended: a group it left up ends here too (a process that exits
            # with a gloo group up after a collective can abort in gloo's threads:
            # "terminate called without an active exception")
            dist.destroy_process_group()
    except Exception as exc:  # another rank died: its rows never come
        return replace(report, notes=report.notes + (
            f"the other ranks' figures could not be gathered ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}): this is rank {rank}'s alone",))
    if rows is None:
        return report
    return replace(report, job=JobRanks(world_size, tuple(rows), rank))
