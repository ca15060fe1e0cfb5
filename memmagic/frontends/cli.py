"""The command line: ``python -m memmagic run [--gpu A100-80GB] [--steps N] [--time-limit
SECONDS] [--world-size N] train.py [script args]`` (or ``-m package.module [args]``) runs a
training script on the simulated GPU (as ``__main__``, with its own argparse:
:mod:`.scriptrun`) through the same pipeline as a
``%%gpumem`` cell, over a scratch disk that keeps the script's file changes off the real
one (:mod:`.scratchdisk`); prints the report (and the doctor's ranked fixes after an out of
memory) and can write the JSON report, the timeline PNG and a memory_viz snapshot. Bad
input gets one line on stderr and exit code 2, before the script runs."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from ..backends import DECODE_STEPS

    p = argparse.ArgumentParser(prog="python -m memmagic",
                                description="memmagic from the command line")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a training script on the simulated GPU",
                         description="Run SCRIPT as __main__ (with its own arguments after "
                                     "it) on memmagic's simulated GPU and print the report.")
    run.add_argument("--gpu", default=None, help="the card to simulate (T4, A100-80GB, ...)")
    run.add_argument("--gpu-memory", default=None, help="a card's size instead (e.g. 10GiB)")
    run.add_argument("--backend", default="sim", choices=("sim", "cpu", "cuda", "auto"),
                     help="where to run (default: the simulated GPU)")
    run.add_argument("--steps", type=int, default=None,
                     help="stop the script after this many optimizer steps (forward passes "
                          "when it makes no optimizer)")
    run.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                     help="stop the script after this many seconds")
    run.add_argument("--whatif", action="append", default=None, metavar="KNOB=VALUE",
                     help="run with a memory-saving knob applied, as %%%%gpumem's options: "
                          "amp=bf16, checkpointing=on, weights_dtype=bf16, optimizer=sgd, "
                          "offload=on, grad_mode=no_grad, ... (repeat for several)")
    run.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    run.add_argument("--timeline", type=Path, default=None, help="write the timeline PNG here")
    run.add_argument("--snapshot", type=Path, default=None,
                     help="write a memory_viz snapshot (pickle) here")
    run.add_argument("--world-size", type=int, default=None, metavar="N",
                     help="run as rank 0 (or --rank R) of an N-GPU job, as torchrun starts it "
                          "(its environment, N GPUs a node up to 8, init_process_group on a "
                          "fake process group): the report is one GPU's")
    run.add_argument("--rank", type=int, default=None, metavar="R",
                     help="with --world-size: run as rank R instead of 0 (RANK, LOCAL_RANK, "
                          "GROUP_RANK as torchrun sets them, the process group's rank): ranks "
                          "differ where a script makes them (rank 0 logs and saves)")
    run.add_argument("--gpus-per-node", type=int, default=None, metavar="K",
                     help="with --world-size: nodes of K GPUs each (torchrun's "
                          "--nproc-per-node; default: the job's GPUs, up to 8): what "
                          "torch.cuda.device_count(), LOCAL_RANK and LOCAL_WORLD_SIZE say")
    run.add_argument("--ranks", default=None, metavar="all|R,R,...",
                     help="with --world-size: run the script as each of these ranks (all: "
                          "every rank), print each rank's peak and show the report of the rank "
                          "that needs the most, which decides whether the job fits")
    run.add_argument("--decode-steps", default=None, choices=DECODE_STEPS,
                     help="generate()'s decode steps and an evaluation loop's repeated forward "
                          "passes on the simulated GPU: evaluate (default: read off the ones "
                          "that ran, checked by ones that run) or run (every one op by op)")
    run.add_argument("-m", dest="module", default=None, metavar="MODULE",
                     help="run a module as python -m MODULE does (its arguments follow it)")
    run.add_argument("script", type=Path, nargs="?", help="the Python script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p


def _write(report: Any, args: argparse.Namespace, run_notes: Sequence[str] = ()) -> list[str]:
    """Write the files asked for (the JSON's notes end with the run's: what cut it, what
    the script wrote); the lines that say where."""
    lines = []
    if args.json is not None:
        data = report.to_dict()
        data["notes"] = [*data.get("notes", ()), *run_notes]
        args.json.write_text(json.dumps(data, indent=1, default=str))
        lines.append(f"report written to {args.json}")
    if args.timeline is not None:
        from ..charts.plots import figure_png, timeline_figure

        args.timeline.write_bytes(figure_png(timeline_figure(report)))
        lines.append(f"timeline written to {args.timeline}")
    if args.snapshot is not None:
        from ..core.snapshot import write_snapshot

        write_snapshot(report, args.snapshot)
        lines.append(f"memory_viz snapshot written to {args.snapshot} (open it at "
                     "https://pytorch.org/memory_viz)")
    return lines


def run_script(args: argparse.Namespace) -> int:
    """``python -m memmagic run``: 0 when the script ran (and fits the card), 1 when it
    failed or ran out of memory, 130 when it was interrupted (Ctrl-C), 2 for bad input (one
    line on stderr, before the run) and for a script that did what the run cannot keep off
    the disk (refused before it changed anything)."""
    from ..jobs import gather_ranks, job_ranks, run_job, torchrun_rank
    from ..pipeline import CellRequest, RequestError
    from .scriptrun import ScriptRun, find_module, load_script

    problem = _bad_input(args)
    spec = None
    script_args = args.args[1:] if args.args[:1] == ["--"] else list(args.args)
    if problem is None:
        try:
            knobs = _whatif_knobs(args.whatif or ())
            if args.module is not None:
                args.script, spec = find_module(args.module, script_args)
            source, code = load_script(args.script)
        except ValueError as exc:
            problem = str(exc)
    if problem is not None:
        return _fail(problem)
    runner = ScriptRun(code, args.script, script_args, args.steps, args.time_limit, module=spec,
                       source=source)
    problem = _knob_not_taken(knobs, {**runner.assigned, **runner.flags})
    if problem is not None:
        return _fail(problem)
    request = CellRequest(source, {}, backend=args.backend, gpu=args.gpu,
                          gpu_memory=args.gpu_memory, run=runner, knobs=knobs,
                          world_size=args.world_size, rank=args.rank,
                          gpus_per_node=args.gpus_per_node, decode_steps=args.decode_steps,
                          # the time limit cuts the script where it is; the simulation's own
                          # bound must not come first
                          max_seconds=_sim_bound(args.backend, args.time_limit),
                          unit="script")
    try:
        result = run_job(request, job_ranks(args.world_size, args.rank, args.ranks),
                         fresh=lambda: _fresh(runner),
                         on_rank=lambda row, report: _told(args.world_size, row))
    except RequestError as exc:
        return _fail(str(exc))
    job = torchrun_rank()
    if job is not None and args.world_size is None and result.report.backend != "sim":
        result.report = gather_ranks(result.report, *job)  # each rank's real run
        _per_rank_files(args, job[0])
    return _show(result, runner, args)


def _per_rank_files(args: argparse.Namespace, rank: int) -> None:
    """Under torchrun every rank writes its own files: rank 0 the paths given (its report
    has the job's table), rank R ``name.rankR.suffix`` beside them."""
    if rank == 0:
        return
    for name in ("json", "timeline", "snapshot"):
        path = getattr(args, name)
        if path is not None:
            setattr(args, name, path.with_name(f"{path.stem}.rank{rank}{path.suffix}"))


def _fresh(runner: Any) -> dict[str, Any]:
    """The namespace a run of the script starts from."""
    return {**runner.base, **runner.initial_values()}


def _told(world_size: int, row: Any) -> None:
    """A line on stderr as each rank of ``--ranks`` ends."""
    print(f"memmagic: rank {row.rank} of {world_size}: {row.line}", file=sys.stderr, flush=True)


def _knob_not_taken(knobs: dict[str, Any], takes: dict[str, Any]) -> str | None:
    """Why a ``--whatif`` knob cannot apply to the script (None: they all can): a knob a
    script is given only on its own command line (``Knob.script_flags``) needs a script
    that takes it there, or sets it as a number at its top level (``takes``: the knob
    variables it takes either way)."""
    from ..whatif.knobs import KNOBS

    for knob in KNOBS.values():
        if knob.script_flags and knob.name in knobs and knob.var not in takes:
            return (f"--whatif {knob.name} needs a script that takes its {knob.label} on its "
                    f"command line (--{knob.name} N, which memmagic then sets for each run) "
                    f"or sets it as a number at its top level ({knob.var} = 64)")
    return None


def _fail(message: str) -> int:
    print(f"memmagic: {message}", file=sys.stderr)
    return 2


def _bad_input(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line (one line that says what to do), or None."""
    from ..jobs import job_ranks
    from .options import check_card_options

    if args.module is None and args.script is None:
        return "give the script to run (python -m memmagic run train.py), or -m MODULE"
    if args.module is None and not args.script.is_file():
        return f"no script at {args.script}: give the path of a Python file"
    if args.steps is not None and args.steps < 1:
        return "--steps needs a positive number of optimizer steps"
    if args.time_limit is not None and not args.time_limit > 0:
        return "--time-limit needs a positive number of seconds"
    try:
        job_ranks(args.world_size, args.rank, args.ranks)
    except ValueError as exc:
        return str(exc)
    try:  # the magic's own check: an empty card would run with no target and no word
        check_card_options(args.gpu, args.gpu_memory)
    except ValueError as exc:
        return str(exc)
    for option in ("json", "timeline", "snapshot"):
        path = getattr(args, option)
        why = None if path is None else _unwritable(path)
        if why is not None:
            return f"--{option} {path}: {why}"
    return None


def _unwritable(path: Path) -> str | None:
    """Why memmagic could not write its output to ``path`` after the run (None: it can)."""
    if path.is_dir():
        return "is a directory: give the path of a file"
    if path.exists():
        return None if os.access(path, os.W_OK) else "cannot be written: give one you can write"
    folder = path.parent
    if not folder.is_dir():
        return f"the folder {folder} does not exist: make it, or give a path in one that does"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} cannot be written: give a path you can write"
    return None


def _show(result: Any, runner: Any, args: argparse.Namespace) -> int:
    """Print the run's report, notes and outcome; write the files asked for."""
    from .scratchdisk import RefusedCall

    report, error = result.report, result.error
    if isinstance(error, RefusedCall):
        return _fail(f"{_script_line(error, args.script)}{error}")
    print(report.summary())
    run_notes = _run_notes(runner, args, error, doctor=report.fits is False)
    for line in run_notes:
        print(f"  note: {line}")
    try:
        for line in _write(report, args, run_notes):
            print(line)
    except OSError as exc:
        return _fail(f"could not write {exc.filename or 'the output'}: {exc.strerror or exc}")
    if isinstance(error, KeyboardInterrupt):  # Ctrl-C: the report so far, and the shell's code
        print("memmagic: interrupted (Ctrl-C); the report covers the run until then",
              file=sys.stderr)
        return 130
    if error is not None:
        if result.out_of_memory:
            print(result.oom_message(), file=sys.stderr)
        else:
            print("".join(_traceback(error)), end="", file=sys.stderr)
            from ..core.failures import error_text

            print(f"memmagic: the script failed: {error_text(error)}" + _data_hint(error),
                  file=sys.stderr)
        advice = report.advice
        if advice is not None and advice.failure is not None and advice.failure.freed is None:
            advice = replace(advice, failure=None)  # no %debug here: the process ends
        for line in advice.lines() if advice is not None else ():
            print(line)
        return 1
    return 0 if report.fits is not False else 1


# forward passes with gradients off from which a run's notes say what they cost
EVALUATION_NOTE_AT = 50


def _run_notes(runner: Any, args: argparse.Namespace, error: BaseException | None,
               doctor: bool = True) -> list[str]:
    """What cut the run (or that it ended early), where the batch and context are set (and
    that the doctor's re-runs set them there, where it did not fit: ``doctor``), and what
    the script changed on its scratch disk."""
    from .scriptflags import flag_value

    p, notes = runner.progress, []
    if p.cut == "steps":
        notes.append(f"stopped after {p.steps} optimizer step(s) (--steps {args.steps})")
    elif p.cut == "forwards":
        notes.append(f"stopped after {p.forwards} forward passes (--steps {args.steps}: the "
                     "script made no optimizer, so its forward passes were counted)")
    elif p.cut == "time":
        notes.append(f"stopped at --time-limit {args.time_limit:g} s, after {p}")
    elif args.steps is not None and error is None:
        done = (f"{p.steps} optimizer step(s)" if p.made_optimizer
                else f"{p.forwards} forward passes")
        notes.append(f"the script ended after {done}, before --steps {args.steps}")
    if p.no_grad_forwards >= EVALUATION_NOTE_AT:
        notes.append(f"the script ran {p.no_grad_forwards} forward passes with gradients off "
                     "(an evaluation): the simulation runs each one that does not repeat the "
                     "calls before it exactly (the others are evaluated, as a note says), and "
                     "each re-run of the doctor repeats them; fewer evaluation batches in the "
                     "script's own options shorten every run")
    who = ("the doctor's re-runs set smaller ones there" if doctor
           else "--whatif {var}=N sets another there")
    for var, (line, _value) in runner.assigned_only().items():
        notes.append(f"the script sets {runner.numbers.written(var)} at line {line}: "
                     f"{who.format(var=var)} (in memory; the file is not changed)")
    for var, (flag, value) in runner.found.items():
        given = flag_value(runner.argv, flag) is not None
        notes.append(f"the script takes {var} on its command line ({flag}=N; it ran with "
                     f"{value}, {'as given' if given else 'its own default'})"
                     + (": the doctor's re-runs pass it smaller ones there" if doctor else ""))
    if runner.exited_on_oom is not None:
        notes.append(f"the script caught the out of memory and exited (sys.exit("
                     f"{runner.exited_on_oom!r}), as hydra's main does after it prints the "
                     "error): the report is the out of memory's")
    changes = runner.changes.note()
    if changes:
        notes.append(changes)
    if runner.changes.refused:
        notes.append("the script carried on without what memmagic run refused to do: "
                     + "; ".join(runner.changes.refused))
    return notes


def _traceback(error: BaseException) -> list[str]:
    """The failed script's traceback as Python shows it, memmagic's own frames left out
    (of each exception of the chain); a simulation's own error (a call it cannot
    simulate, which its one line explains) without the chain of how it found that."""
    from ..backends.sim import SimulationError
    from ..core.failures import PACKAGE_DIR

    shown = traceback.TracebackException.from_exception(error)
    if isinstance(error, SimulationError):
        shown.__cause__ = shown.__context__ = None
    seen, each = set(), [shown]
    while each:
        te = each.pop()
        if te is None or id(te) in seen:
            continue
        seen.add(id(te))
        te.stack = traceback.StackSummary.from_list(
            [f for f in te.stack if not f.filename.startswith(PACKAGE_DIR)])
        each += [te.__cause__, te.__context__]
    return list(shown.format())


def _script_line(error: BaseException, script: Path) -> str:
    """``train.py line 7: `` for the script's line in the error's traceback ('' if none)."""
    tb, line = error.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == str(script):
            line = tb.tb_lineno
        tb = tb.tb_next
    return "" if line is None else f"{script} line {line}: "


def _whatif_knobs(items: Sequence[str]) -> dict[str, Any]:
    """``--whatif KNOB=VALUE`` options as the pipeline's knobs (an integer knob's value as a
    number); ValueError says what is wrong."""
    from ..whatif.knobs import KNOBS

    knobs: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not value.strip():
            raise ValueError(f"--whatif takes KNOB=VALUE (e.g. amp=bf16), not {item!r}")
        knob = KNOBS.get(name)
        if knob is None:
            raise ValueError(f"--whatif: unknown knob {name!r}; knobs: {', '.join(KNOBS)}")
        value = value.strip()
        if knob.kind == "int":
            try:
                value = int(value)
            except ValueError:
                raise ValueError(f"--whatif {name} takes a whole number, not {value!r}") from None
        knobs[name] = value
    return knobs


def _data_hint(error: BaseException) -> str:
    """What to stub when the script reads data that is not here."""
    if isinstance(error, FileNotFoundError) and error.filename:
        return (f" (the script reads {error.filename}, which is not here: run it where its data "
                "is, or give it a small stand-in file of the same shape; on the simulated GPU "
                "only shapes matter)")
    if isinstance(error, OSError) and "huggingface" in str(error).lower():
        return (" (the script downloads from the Hugging Face hub: build the model from its "
                "config instead, e.g. AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(...)), "
                "or run where the hub is reachable)")
    return ""


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    """The command line; after ``-m MODULE`` (before any script), everything is the
    module's own arguments, as ``python -m MODULE args`` takes them."""
    parser = _parser()
    if "-m" in argv:
        at = list(argv).index("-m")
        head = parser.parse_args(list(argv[:at + 2]))
        if head.script is None:  # no script before it: -m is memmagic's
            head.args = list(argv[at + 2:])
            return head
    return parser.parse_args(list(argv))


def _sim_bound(backend: str, time_limit: float | None) -> float | None:
    """The simulated run's bound for ``--time-limit`` (None: the backend's own, 120 s):
    past it, so that the time limit stops the script first."""
    from ..backends.sim import SimBackend

    default = SimBackend.DEFAULT_MAX_SECONDS
    if backend != "sim" or time_limit is None or time_limit < default:
        return None
    return time_limit + default


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("MPLBACKEND", "Agg")
    if args.command == "run":
        return run_script(args)
    return 2
