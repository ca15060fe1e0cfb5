"""The options of ``%%gpumem`` that are not knobs, as data: (flags, argparse keyword
arguments). The magic builds its parser from these and one option per knob of
:data:`memmagic.whatif.knobs.KNOBS` (placed between the two lists)."""

from __future__ import annotations

import argparse

from ..backends import BACKEND_NAMES, DECODE_STEPS

__all__ = ["OPTIONS", "check_card_options", "check_options", "unquote", "line_problem", "views"]

# (flags, argparse options) of the options that are not knobs; the knobs' go between the two
OPTIONS = [
    (("--backend",), dict(
        choices=BACKEND_NAMES, default=None,
        help="Where to measure: cuda (real GPU allocator), cpu (real run on the CPU, tensors "
             "tracked op by op), sim (simulated CUDA GPU on fake tensors, no GPU needed; every "
             "sim cell of the notebook shares one simulated GPU), auto (cuda when a GPU is "
             "usable, else cpu). Default: auto, or sim after %%gpusim on.")),
    (("--device",), dict(type=int, default=None, metavar="N",
                         help="CUDA device index for --backend cuda (default: the current device).")),
    (("--gpu",), dict(default=None, metavar="NAME",
                      help="Target GPU for --backend sim, e.g. T4, A100-40GB, RTX4090, laptop-6GB: "
                           "the report says whether the cell fits.")),
    (("--gpu-memory",), dict(
        default=None, metavar="SIZE",
        help="Target GPU memory for --backend sim, with a unit: 10GiB, 16GB, 512MiB (64 MiB "
             "to 4 TiB). With --gpu it replaces the card's memory: --gpu T4 --gpu-memory 6GiB "
             "simulates a T4 (its kernels) with 6 GiB, named 'T4 with 6.00 GiB' in the report, "
             "with a note.")),
    (("--world-size",), dict(
        type=int, default=None, metavar="N",
        help="--backend sim: the simulated GPU is rank 0 (or --rank R) of N GPUs on a fake "
             "process group, so "
             "the cell's init_device_mesh, parallelize_module (tensor parallel) and fully_shard "
             "(FSDP2, 2-D with TP) run as on one GPU of the job; the report is per GPU. The "
             "cell runs on a copy of the notebook's simulated GPU (its names stay as they were).")),
    (("--rank",), dict(
        type=int, default=None, metavar="R",
        help="With --world-size: the simulated GPU is rank R of the job instead of rank 0 "
             "(torch.distributed.get_rank(), RANK and LOCAL_RANK say R; its device is "
             "cuda:LOCAL_RANK).")),
    (("--gpus-per-node",), dict(
        type=int, default=None, metavar="K",
        help="With --world-size: the job's nodes have K GPUs each (torchrun's "
             "--nproc-per-node): torch.cuda.device_count(), LOCAL_RANK and LOCAL_WORLD_SIZE "
             "follow it (default: the job's GPUs, up to 8).")),
    (("--ranks",), dict(
        default=None, metavar="all|R,R",
        help="With --world-size: run the cell as each of these ranks (all: every rank, up to "
             "64) and report the rank that decides whether the job fits (one that failed, "
             "else the one that needs the most), with every rank's figures.")),
    (("--decode-steps",), dict(
        default=None, choices=DECODE_STEPS,
        help="--backend sim: how transformers' generate() runs its decode steps: evaluate "
             "(default: three run op by op draw a line, the next ones are read off it and done "
             "on the allocator model, checked by steps that run at doubling intervals and by "
             "the last; an evaluation loop's forward passes that repeat the two before them are "
             "done on the allocator model, checked by calls that run; a note says so) or run "
             "(every step and every call op by op, about 0.2 s a token on a 1B model).")),
    (("--max-seconds",), dict(
        type=float, default=None, metavar="S",
        help="--backend sim: how long the cell may simulate before it stops (default 120 s); "
             "a training loop of many steps needs more.")),
    (("--no-breakdown",), dict(action="store_true",
                               help="cuda only: skip the per-category breakdown (lowest overhead).")),
    (("--no-chart",), dict(action="store_true", help="Do not draw the breakdown chart.")),
    (("-o", "--output"), dict(action="store_true",
                              help="Return the MemoryReport (IPython shows it as the cell's result; "
                                   "the magic then does not display it too).")),
    (("-v", "--var"), dict(default=None, metavar="NAME",
                           help="Store the MemoryReport in the variable NAME.")),
    (("-q", "--quiet"), dict(action="store_true", help="Print nothing.")),
    (("--no-raise",), dict(action="store_true",
                           help="A cell that runs out of memory (real or simulated) shows its report "
                                "as the verdict and does not raise, so Run All goes on.")),
    (("--footer",), dict(action="store_true",
                         help="One line instead of the full report (what %%gpusim on uses).")),
], [
    (("--timeline",), dict(action="store_true",
                           help="Also draw the memory over the run (op by op, with forward, backward "
                                "and optimizer phases marked); cpu and sim backends.")),
    (("--snapshot",), dict(default=None, metavar="PATH",
                           help="Write the run as a CUDA memory snapshot (pickle) that "
                                "https://pytorch.org/memory_viz opens; cpu and sim backends.")),
    (("--whatif",), dict(
        action="store_true",
        help="Show a panel of controls for the knobs that apply to the cell; every change re-runs "
             "the cell (on the simulated GPU unless --backend says otherwise) and redraws the "
             "memory against the baseline. Needs ipywidgets 8.")),
    (("--range",), dict(action="append", default=None, metavar="KNOB=LO:HI",
                        help="The panel's range of an integer knob, e.g. batch_size=1:512.")),
    (("--sweep",), dict(
        default=None, metavar="KNOB=LO:HI",
        help="Run the knob across the powers of two from LO to HI (or a list: batch_size=8,16,32) "
             "for each strategy (AMP, checkpointing) and plot the memory against it, with the "
             "largest value that fits the card. Values between two runs that the run between "
             "them shows to be on a straight line are replayed, not run (rings on the chart).")),
    (("--fitmap",), dict(
        nargs="?", const="", default=None, metavar="batch=LO:HI,seq=LO:HI,step=N",
        help="The fit map: for the target card (--gpu), which pairs of batch size and context "
             "length fit, as a chart of the plane with its boundary (default: batch 1:64, "
             "context 128 up to twice the cell's, up to 64 contexts, multiples of step=128). "
             "Read off four or six runs of the cell where each "
             "allocation's size is a polynomial in the two, checked by runs; otherwise run pair "
             "by pair.")),
    (("--advise",), dict(
        action="store_true",
        help="The memory doctor: after the cell, who holds the memory it left (names, the "
             "autograd graphs they pin, the classic leaks with their fix); after an out of "
             "memory, the fixes ranked by re-running the cell with each on the simulated GPU, "
             "and FSDP2 over 2, 4 and 8 GPUs. A failed cell gets the doctor's short advice "
             "without it.")),
    (("statement",), dict(nargs=argparse.REMAINDER, help="Line magic: the statement to measure.")),
]


def check_card_options(gpu: str | None, gpu_memory: str | None, *,
                       no_card: str = "leave --gpu out") -> None:
    """Raise ValueError when ``--gpu`` or ``--gpu-memory`` was given an empty value
    (``--gpu ""``), which would otherwise run with no target card and no word. ``no_card``
    says how to do without a card (``%gpusim on`` has ``--gpu none``)."""
    if gpu is not None and not gpu.strip():
        from ..backends.sim import GPUS

        names = ", ".join(g.name for g in GPUS.values())
        raise ValueError(f"--gpu needs a card name, one of {names}; or {no_card}")
    if gpu_memory is not None and not gpu_memory.strip():
        raise ValueError("--gpu-memory needs a size with a unit, like --gpu-memory 6GiB; "
                         "or leave --gpu-memory out")


def check_options(args: argparse.Namespace) -> argparse.Namespace:
    """``args``, or ValueError in one line that says what to do for options of ``%%gpumem``
    that cannot run as given: an empty card, options that do not go together. Sets
    ``args.job``: the ranks to run as (None: one run)."""
    from ..jobs import job_ranks

    check_card_options(args.gpu, args.gpu_memory)
    if args.whatif and args.sweep is not None:
        raise ValueError("--whatif and --sweep are two views of the cell: give one (the "
                         "panel's 'sweep batch size' button runs a sweep inside it)")
    if args.fitmap is not None and (args.whatif or args.sweep is not None):
        raise ValueError("--fitmap is a view of the cell of its own: give it without --whatif "
                         "and --sweep")
    if args.ranks is not None and views(args):
        raise ValueError("--ranks runs the cell once per rank: give it without --whatif, "
                         "--sweep and --fitmap (those re-run one rank: --rank R)")
    args.job = job_ranks(args.world_size, args.rank, args.ranks)
    if args.range and not args.whatif:
        raise ValueError("--range sets a knob's range in the --whatif panel: add --whatif "
                         "(a sweep takes its range itself: --sweep batch_size=1:512)")
    return args


def views(args: argparse.Namespace) -> bool:
    """Whether the line asks for a view of the cell re-run (the panel, a sweep, the fit map)
    rather than one run of it."""
    return args.whatif or args.sweep is not None or args.fitmap is not None


def unquote(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the quotes taken off the options' values: IPython splits a magic's line
    keeping them (``--gpu "T4"`` reads '"T4"'); the line magic's statement keeps its own."""
    def bare(value):
        if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] in "'\"":
            return value[1:-1]
        return value

    for name, value in vars(args).items():
        if name != "statement":
            setattr(args, name, [bare(v) for v in value] if isinstance(value, list) else bare(value))
    return args


def line_problem(error: ValueError) -> str:
    """The one line to show for a magic's line that cannot be read: shlex's "No closing
    quotation" says what to do; other messages (:func:`check_options`') already do."""
    if str(error) == "No closing quotation":
        return 'a quote is not closed: close it (--gpu "A100-80GB") or leave the quotes out'
    return str(error)
