"""The entry point: ``python -m benchmarks [--quick] [--gpu] [--out DIR] [--only a,b,...]``."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

from .common import RESULTS_DIR, Figure, code_version, machine_info, write_results

__all__ = ["main", "RESULTS_DIR"]
FIGURES = ("a", "b", "c", "d", "e", "f", "w", "s", "m", "t", "p", "g")
# the what-if panel, trace-cost, doctor-at-scale, fit-map, torchtitan, panel-at-scale and
# generate() figures: a full run or --only
QUICK_SKIPS = {"w", "f", "s", "m", "t", "p", "g"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="two small cases (test size), checkpointing off, few repetitions")
    p.add_argument("--gpu", action="store_true",
                   help="the CUDA figures (skips cleanly without a usable GPU)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for the JSON (default: results/)")
    p.add_argument("--only", default=None,
                   help="comma-separated figures to run, from a,b,c,d,e,f,w,s,m,t,p,g (default: "
                        "all; --quick leaves out w, f, s, m, t, p and g)")
    p.add_argument("--reps", type=int, default=None, help="pairs per timing (default 3)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for the run (default 1; 0 keeps torch's default). "
                        "On a shared machine a second OpenMP thread stalls whenever another "
                        "process holds a core, which made paired timings differ by up to 50x")
    p.add_argument("--whatif-probe", default="sim-rerun", help="what the what-if figure times")
    p.add_argument("--torchtitan", type=Path, default=None, metavar="DIR",
                   help="figure t: a checkout of pytorch/torchtitan (v0.2.0) whose trainer runs "
                        "on simulated H100s (without it the figure says so)")
    p.add_argument("--against", default=None, metavar="REV",
                   help="figures w, s, g, m and p: measure each case with commit REV's memmagic "
                        "too, beside this tree's (each in a fresh process, alternating)")
    return p


def _selected(args: argparse.Namespace) -> set[str]:
    """The figures to run, from ``--only`` (default: all, less the slow ones with --quick)."""
    if args.only is None:
        only = set(FIGURES) - (QUICK_SKIPS if args.quick else set())
    else:
        only = {x.strip() for x in args.only.split(",") if x.strip()}
    if not only <= set(FIGURES):
        raise SystemExit(f"--only takes figures from {','.join(FIGURES)}, got {args.only!r}")
    return only


@contextlib.contextmanager
def _against(args: argparse.Namespace) -> Iterator[Any]:
    """The commit ``--against`` names, extracted while the figures use it (None without it)."""
    from .against import Against

    against = Against(args.against, args.threads) if args.against else None
    try:
        yield against
    finally:
        if against is not None:
            against.close()


def _run_figures(only: set[str], args: argparse.Namespace, size: str, reps: int,
                 show: Callable[[Figure], None]) -> None:
    """Run the CPU figures in ``only``, handing each to ``show`` as it is done."""
    from . import figures as F
    from .cases import ALL_CASES, QUICK_CASES, REAL_CPU_CASES, Config, matrix

    real = matrix(QUICK_CASES if args.quick else REAL_CPU_CASES, size, quick=args.quick)
    every = real if args.quick else matrix(ALL_CASES, size)
    if "a" in only:
        show(F.overhead(real, reps))
        show(F.overhead_profile(Config("transformer", False, False, size), reps))
    if "b" in only:
        show(F.sim_speed(every, reps))
    truth: dict = {}
    if "c" in only or "d" in only:
        fig_c, truth = F.accuracy(real)
        if "c" in only:
            show(fig_c)
            show(F.accuracy_loops(real))
    if "d" in only:
        show(F.peers(every, truth))
    if "e" in only:
        show(F.whatif(Config("transformer", False, False, size), 5 if args.quick else 20,
                      args.whatif_probe))
    if "f" in only:
        from .trace_cost import trace_cost

        show(trace_cost(real, reps))
    if "w" in only:
        with _against(args) as against:
            show(F.whatif_panel(size, 5 if args.quick else 20,
                                ("transformer",) if args.quick else REAL_CPU_CASES, against))
            show(F.whatif_sweep(size, against=against))
    if "m" in only:
        with _against(args) as against:
            show(F.fit_map_figure(args.threads, against))
        show(F.symbolic_cost_figure(args.threads))
    if "p" in only:
        from .panel_scale import panel_scale_figure

        with _against(args) as against:
            show(panel_scale_figure(args.threads, against))
    if "g" in only:
        from .generate_scale import generate_scale_figure

        with _against(args) as against:
            show(generate_scale_figure(args.threads, against))
    if "t" in only:
        from .torchtitan import torchtitan_figure

        show(torchtitan_figure(args.torchtitan))
    if "s" in only:
        with _against(args) as against:
            show(F.doctor_scale(against, args.threads))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = "python -m benchmarks" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    if args.gpu:
        from .gpu import run_gpu

        return run_gpu(args, command)
    only = _selected(args)

    import torch

    from .render import text_table

    started = time.perf_counter()
    code = code_version()  # before any figure: files edited during the run do not count
    torch.manual_seed(0)
    # the simulated device asks torch.backends.cudnn about CUDA RNNs on a CPU-only build
    warnings.filterwarnings("ignore", message="PyTorch was compiled without cuDNN")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    size = "test" if args.quick else "bench"
    reps = args.reps or 3
    figs: list[Figure] = []

    def show(fig: Figure) -> None:
        figs.append(fig)
        print(text_table(fig.to_dict()), flush=True)
        print(flush=True)

    print(f"memmagic benchmarks ({'quick' if args.quick else 'full'}, zoo size {size!r}) on "
          f"{machine_info()['label']}, torch {torch.__version__}, {torch.get_num_threads()} torch "
          f"thread(s)", flush=True)
    _run_figures(only, args, size, reps, show)
    path = write_results(figs, kind="cpu", quick=args.quick, out=args.out, command=command,
                         started=started, extra={"size": size, "reps": reps}, code=code)
    misses = [f.key for f in figs if f.status == "miss"]
    print(f"wrote {path} in {time.perf_counter() - started:.0f} s; "
          f"targets missed: {', '.join(misses) if misses else 'none'}", flush=True)
    return 0
