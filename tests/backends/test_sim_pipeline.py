"""Pipeline parallel (``torch.distributed.pipelining``) on simulated ranks: a job's ranks run
in stage order (memmagic.jobs) hand each later stage the shapes of what it receives, and
each stage's peak holds the activations of its micro-batches in flight, as the schedule
keeps them: every micro-batch under GPipe, ``stages - stage`` of them under 1F1B."""

from __future__ import annotations

import textwrap

import pytest

from memmagic.jobs import run_job
from memmagic.pipeline import CellRequest

MiB = 2**20
WIDTH, BATCH, STAGES = 256, 1024, 4

# each rank builds its own stage: two blocks of Linear -> ReLU -> Linear
PIPELINE = textwrap.dedent(f'''
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining as pp

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % 8)
    D = {WIDTH}

    def block():
        return torch.nn.Sequential(torch.nn.Linear(D, 4 * D), torch.nn.ReLU(),
                                   torch.nn.Linear(4 * D, D))

    per_rank = 2 if SCHEDULE in ("Interleaved1F1B", "InterleavedZeroBubble") else 1
    ids = [rank + world * v for v in range(per_rank)]
    mods = [torch.nn.Sequential(block(), block()).to(device) for _ in ids]
    stages = [pp.PipelineStage(m, i, world * per_rank, device) for m, i in zip(mods, ids)]
    cls = getattr(pp, "Schedule" + SCHEDULE)
    sched = cls(stages if per_rank > 1 else stages[0], n_microbatches=MICROBATCHES,
                loss_fn=lambda out, target: torch.nn.functional.mse_loss(out, target))
    x = torch.randn({BATCH}, D, device=device)
    y = torch.randn({BATCH}, D, device=device)
    kwargs = dict(target=y, losses=[]) if any(s.is_last for s in stages) else {{}}
    if any(s.is_first for s in stages):
        sched.step(x, **kwargs)
    else:
        sched.step(**kwargs)
''')


def _ranks(schedule: str, microbatches: int, ranks=range(STAGES)) -> dict:
    """Each rank's report of the job, by rank."""
    source = f"SCHEDULE = {schedule!r}\nMICROBATCHES = {microbatches}\n" + PIPELINE
    reports = {}
    result = run_job(CellRequest(source, {}, backend="sim", gpu="H100", world_size=STAGES),
                     list(ranks), on_rank=lambda row, report: reports.__setitem__(row.rank, report))
    assert result.error is None, result.error
    assert result.report.job is not None and len(result.report.job.rows) == len(ranks)
    return reports


def _held(report, module: str) -> int:
    """The most bytes ``module`` held saved for backward at any moment of the run."""
    return next(r.activations_max for r in report.modules if r.module.endswith("." + module))


@pytest.mark.parametrize("schedule, in_flight", [
    ("GPipe", lambda stage, n: n),                    # every forward, then every backward
    ("1F1B", lambda stage, n: min(n, STAGES - stage)),  # a warm-up of stages - stage
])
def test_each_stage_holds_the_activations_of_its_micro_batches_in_flight(schedule, in_flight):
    n = 8
    reports = _ranks(schedule, n)
    relu = (BATCH // n) * 4 * WIDTH * 4  # one micro-batch's ReLU output, fp32
    for stage, report in reports.items():
        for block in ("0.1", "1.1"):
            assert _held(report, block) == in_flight(stage, n) * relu, (schedule, stage, block)
        # a stage's own weights: two blocks of 8 D^2 + 5 D floats
        assert report.breakdown["parameters"] == 2 * (8 * WIDTH**2 + 5 * WIDTH) * 4
    if schedule == "1F1B":
        assert reports[0].peak > reports[STAGES - 1].peak  # the first stage holds the most


def test_interleaved_and_zero_bubble_schedules_run_every_rank():
    """Two stages a rank (stage r and r + 4): a rank's later stage takes its shapes from a
    rank run after it, which then runs again. Interleaved 1F1B's warm-up on rank r is
    (v - 1) p + 2 (p - 1 - r) forwards (v stages a rank, p ranks), then one more before the
    first backward: 11, 9, 7, 5 micro-batch stages in flight here."""
    n, v, p = 8, 2, STAGES
    relu = (BATCH // n) * 4 * WIDTH * 4
    reports = _ranks("Interleaved1F1B", n)
    for rank, report in reports.items():
        # the rank's two stage modules share their names: the rows sum them
        assert _held(report, "0.1") == ((v - 1) * p + 2 * (p - 1 - rank) + 1) * relu, rank
    reports = _ranks("InterleavedZeroBubble", n)
    assert sorted(reports) == list(range(STAGES))
    for report in reports.values():
        assert 0 < _held(report, "0.1") <= v * n * relu


def test_a_later_stage_alone_says_to_run_the_ranks_together():
    source = "SCHEDULE = 'GPipe'\nMICROBATCHES = 4\n" + PIPELINE
    result = run_job(CellRequest(source, {}, backend="sim", gpu="H100", world_size=STAGES,
                                 rank=2))
    assert "pipeline stage 2 takes the shapes of its inputs from stage 1, which this job has " \
           "not run: run the job's ranks together (--ranks all)" in str(result.error)
