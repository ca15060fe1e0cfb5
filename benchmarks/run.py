"""The entry point: ``python -m benchmarks [--quick] [--gpu] [--out DIR] [--only a,b,...]``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from .common import Figure, machine_info, now_iso, slug

__all__ = ["main", "write_results", "RESULTS_DIR"]

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
FIGURES = ("a", "b", "c", "d", "e", "f", "w")
QUICK_SKIPS = {"w", "f"}  # the what-if panel and trace-cost figures: a full run or --only


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="two small cases (test size), checkpointing off, few repetitions")
    p.add_argument("--gpu", action="store_true",
                   help="the CUDA figures (skips cleanly without a usable GPU)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for the JSON (default: results/)")
    p.add_argument("--only", default=None,
                   help="comma-separated figures to run, from a,b,c,d,e,f,w (default: all; "
                        "--quick leaves out w)")
    p.add_argument("--reps", type=int, default=None, help="pairs per timing (default 3)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for the run (default 1; 0 keeps torch's default). "
                        "On a shared machine a second OpenMP thread stalls whenever another "
                        "process holds a core, which made paired timings differ by up to 50x")
    p.add_argument("--whatif-probe", default="sim-rerun", help="what the what-if figure times")
    return p


def code_version() -> dict[str, Any]:
    """The commit the numbers were taken at, and the memmagic files that differed from it."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            # rstrip only: a porcelain line starts with a space (" M path")
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  timeout=10).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "memmagic", "benchmarks").splitlines()]
    return {"commit": git("rev-parse", "HEAD") or None, "uncommitted": dirty}


def write_results(figures: list[Figure], *, kind: str, quick: bool, out: Path,
                  command: str, started: float, extra: dict[str, Any] | None = None,
                  code: dict[str, Any] | None = None) -> Path:
    """``code``: :func:`code_version` taken when the run started (the code it imported);
    taken now when not given."""
    machine = machine_info()
    ident = slug(machine["gpu"]) if kind == "gpu" and machine["gpu"] else f"{slug(machine['cpu'])}-{machine['cores']}c"
    name = f"{'quick-' if quick else ''}{kind}-{ident}"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    data = {
        "name": name, "file": f"results/{path.name}", "kind": kind, "quick": quick,
        "command": command, "date": now_iso(), "elapsed_s": round(time.perf_counter() - started, 1),
        "machine": machine, "code": code or code_version(), **(extra or {}),
        "figures": {f.key: f.to_dict() for f in figures},
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = "python -m benchmarks" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    if args.gpu:
        from .gpu import run_gpu

        return run_gpu(args, command)
    if args.only is None:
        only = set(FIGURES) - (QUICK_SKIPS if args.quick else set())
    else:
        only = {x.strip() for x in args.only.split(",") if x.strip()}
    if not only <= set(FIGURES):
        raise SystemExit(f"--only takes figures from {','.join(FIGURES)}, got {args.only!r}")

    import torch

    from . import figures as F
    from .cases import ALL_CASES, QUICK_CASES, REAL_CPU_CASES, Config, matrix
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
    real = matrix(QUICK_CASES if args.quick else REAL_CPU_CASES, size, quick=args.quick)
    every = real if args.quick else matrix(ALL_CASES, size)
    figs: list[Figure] = []

    def show(fig: Figure) -> None:
        figs.append(fig)
        print(text_table(fig.to_dict()), flush=True)
        print(flush=True)

    print(f"memmagic benchmarks ({'quick' if args.quick else 'full'}, zoo size {size!r}) on "
          f"{machine_info()['label']}, torch {torch.__version__}, {torch.get_num_threads()} torch "
          f"thread(s)", flush=True)
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
        show(F.whatif_panel(size, 5 if args.quick else 20,
                            ("transformer",) if args.quick else REAL_CPU_CASES))
        show(F.whatif_sweep(size))
    path = write_results(figs, kind="cpu", quick=args.quick, out=args.out, command=command,
                         started=started, extra={"size": size, "reps": reps}, code=code)
    misses = [f.key for f in figs if f.status == "miss"]
    print(f"wrote {path} in {time.perf_counter() - started:.0f} s; "
          f"targets missed: {', '.join(misses) if misses else 'none'}", flush=True)
    return 0
