"""The command line (issue 26, item 1): ``python -m memmagic run train.py [script args]
--gpu A100-80GB [--steps N]`` runs a training script on the simulated GPU (its ``__main__``,
its argparse, its loop cut after N optimizer steps) through the same pipeline as a
``%%gpumem`` cell, prints the report (and the doctor's ranked fixes after an out of
memory) and can write the JSON report, the timeline PNG and a memory_viz snapshot."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

__all__ = ["main"]


class _StepsDone(BaseException):
    """Raised after the last optimizer step asked for (``--steps``): a BaseException, so the
    script's own ``except Exception`` does not catch it."""


def _parser() -> argparse.ArgumentParser:
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
                     help="stop the script after this many optimizer steps")
    run.add_argument("--whatif", action="append", default=None, metavar="KNOB=VALUE",
                     help="run with a memory-saving knob applied, as %%%%gpumem's options: "
                          "amp=bf16, checkpointing=on, weights_dtype=bf16, optimizer=sgd, "
                          "offload=on, grad_mode=no_grad, ... (repeat for several)")
    run.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    run.add_argument("--timeline", type=Path, default=None, help="write the timeline PNG here")
    run.add_argument("--snapshot", type=Path, default=None,
                     help="write a memory_viz snapshot (pickle) here")
    run.add_argument("script", type=Path, help="the Python script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p


class _ScratchWrites:
    """While installed, the files and directories a script makes go to a scratch directory
    instead of the disk (``open`` for writing, ``os.makedirs`` / ``os.mkdir``, and so
    ``pathlib``'s); reads of them, and ``os.path.exists`` / ``isdir`` / ``isfile``, find them
    there. C extensions that write on their own (safetensors' Rust writer) are not seen.
    ``written``: the paths the script wrote (absolute), for the report."""

    _CHECKS = ("exists", "isdir", "isfile")

    def __init__(self) -> None:
        import builtins

        self.written: list[str] = []
        self.scratch = ""
        self.made: dict[str, str] = {}  # real path -> its scratch twin
        self.real = {"open": builtins.open, "mkdir": os.mkdir,  # (os.makedirs calls mkdir)
                     **{name: getattr(os.path, name) for name in self._CHECKS}}

    def _note(self, path: Any) -> str:
        """The scratch twin of ``path``, which the script writes."""
        p = os.path.abspath(os.fspath(path))
        if p not in self.made:
            self.written.append(p)
            self.made[p] = os.path.join(self.scratch, p.lstrip(os.sep))
        return self.made[p]

    def _makedirs(self, path: str) -> None:  # mkdir -p with the real os.mkdir
        if path and not self.real["isdir"](path):
            self._makedirs(os.path.dirname(path))
            self.real["mkdir"](path)

    def open(self, file, mode="r", *args, **kwargs):
        if isinstance(file, int):
            return self.real["open"](file, mode, *args, **kwargs)
        if any(c in mode for c in "wax+"):
            target = self._note(file)
            self._makedirs(os.path.dirname(target))
            return self.real["open"](target, mode, *args, **kwargs)
        p = os.path.abspath(os.fspath(file))
        return self.real["open"](self.made.get(p, file), mode, *args, **kwargs)

    def makedirs(self, name, mode=0o777, exist_ok=False) -> None:
        self._makedirs(self._note(name))

    def mkdir(self, path, mode=0o777, *, dir_fd=None) -> None:
        self._makedirs(self._note(path))

    def _check(self, name: str) -> Any:
        real = self.real[name]

        def check(path) -> bool:
            if real(path):
                return True
            p = os.path.abspath(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else None
            return p in self.made and real(self.made[p])
        return check

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        import builtins
        import io
        import shutil
        import tempfile

        from .patching import Patches

        self.scratch, self.made = tempfile.mkdtemp(prefix="memmagic-script-writes-"), {}
        patches = Patches()
        try:
            for mod in (builtins, io):
                patches.set(mod, "open", self.open)
            patches.set(os, "makedirs", self.makedirs)
            patches.set(os, "mkdir", self.mkdir)
            for name in self._CHECKS:
                patches.set(os.path, name, self._check(name))
            yield
        finally:
            patches.restore()
            shutil.rmtree(self.scratch, ignore_errors=True)


class _ScriptRun:
    """``run(namespace)``: the script as ``__main__`` with its argv and folder on sys.path
    (as ``python script.py`` sets them), cut after ``steps`` optimizer steps; ``done``: the
    steps it ran. sys.argv and sys.path are put back as they were in ``finally``."""

    def __init__(self, source: str, path: Path, argv: list[str], steps: int | None) -> None:
        self.code = compile(source, str(path), "exec")
        self.path, self.argv, self.steps = path, argv, steps
        self.done = 0
        # knob variables the script takes from its command line (``--batch_size 16``): the
        # what-if engine and the doctor set them in the namespace, the run puts them in argv
        self.flags = _knob_flags(argv)
        self.knob_reads = frozenset(self.flags)
        self.base: dict[str, Any] = {"__name__": "__main__", "__file__": str(path),
                                     "__builtins__": __builtins__}
        self.writes = _ScratchWrites()

    def initial_values(self) -> dict[str, int]:
        """The knob variables' values as the command line gives them."""
        return {var: int(_flag_value(self.argv, flag)) for var, flag in self.flags.items()}

    def _argv(self, ns: dict) -> list[str]:
        argv = list(self.argv)
        for var, flag in self.flags.items():
            value = ns.get(var)
            if isinstance(value, int) and not isinstance(value, bool):
                argv = _with_flag_value(argv, flag, str(value))
        return argv

    def _count(self, *_: Any) -> None:
        self.done += 1
        if self.steps is not None and self.done >= self.steps:
            raise _StepsDone

    def __call__(self, ns: dict) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.done = 0
        # each run (the doctor's and the what-if re-runs too) starts from a fresh __main__,
        # as `python script.py` does, with the knob values it is given
        keep = {var: ns[var] for var in self.knob_reads if var in ns}
        ns.clear()
        ns.update(self.base)
        ns.update(keep)
        saved_argv, saved_path = sys.argv, list(sys.path)
        sys.argv = [str(self.path), *self._argv(ns)]
        sys.path.insert(0, str(self.path.parent))
        handle = register_optimizer_step_post_hook(self._count)
        try:
            with self.writes.installed():
                exec(self.code, ns)
        except _StepsDone:
            pass
        except SystemExit as exc:  # the script's own sys.exit() / argparse's
            if exc.code not in (None, 0):
                raise
        finally:
            handle.remove()
            sys.argv = saved_argv
            sys.path[:] = saved_path


# a script's own options that carry a knob's value (argparse's dest is the knob's variable)
_KNOB_FLAGS = {"batch_size": ("--batch_size", "--batch-size"),
               "seq_len": ("--seq_len", "--seq-len"),
               "accum_steps": ("--accum_steps", "--accum-steps")}


def _knob_flags(argv: Sequence[str]) -> dict[str, str]:
    """knob variable -> the option of ``argv`` that gives it a whole number."""
    out = {}
    for var, flags in _KNOB_FLAGS.items():
        for flag in flags:
            value = _flag_value(argv, flag)
            if value is not None and value.isdigit():
                out[var] = flag
    return out


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1:]
    return None


def _with_flag_value(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    for i, a in enumerate(out):
        if a == flag and i + 1 < len(out):
            out[i + 1] = value
        elif a.startswith(flag + "="):
            out[i] = f"{flag}={value}"
    return out


def _write(report: Any, args: argparse.Namespace) -> list[str]:
    lines = []
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_dict(), indent=1, default=str))
        lines.append(f"report written to {args.json}")
    if args.timeline is not None:
        from .plots import figure_png, timeline_figure

        args.timeline.write_bytes(figure_png(timeline_figure(report)))
        lines.append(f"timeline written to {args.timeline}")
    if args.snapshot is not None:
        from .snapshot import write_snapshot

        write_snapshot(report, args.snapshot)
        lines.append(f"memory_viz snapshot written to {args.snapshot} (open it at "
                     "https://pytorch.org/memory_viz)")
    return lines


def run_script(args: argparse.Namespace) -> int:
    """``python -m memmagic run``: 0 when the script ran (and fits the card), 1 when it
    failed or ran out of memory, 2 for bad input."""
    from .pipeline import CellRequest, RequestError, run_cell

    path = args.script
    if not path.is_file():
        print(f"memmagic: no script at {path}: give the path of a Python file", file=sys.stderr)
        return 2
    if args.steps is not None and args.steps < 1:
        print("memmagic: --steps needs a positive number of optimizer steps", file=sys.stderr)
        return 2
    try:
        knobs = _whatif_knobs(args.whatif or ())
    except ValueError as exc:
        print(f"memmagic: {exc}", file=sys.stderr)
        return 2
    script_args = args.args[1:] if args.args[:1] == ["--"] else list(args.args)
    source = path.read_text()
    runner = _ScriptRun(source, path, script_args, args.steps)
    ns: dict[str, Any] = {**runner.base, **runner.initial_values()}
    request = CellRequest(source, ns, backend=args.backend, gpu=args.gpu,
                          gpu_memory=args.gpu_memory, run=runner, knobs=knobs)
    try:
        result = run_cell(request)
    except RequestError as exc:
        print(f"memmagic: {exc}", file=sys.stderr)
        return 2
    report, error = result.report, result.error
    print(report.summary())
    if args.steps is not None and error is None:
        ran = runner.done
        print(f"  note: stopped after {ran} optimizer step(s) (--steps {args.steps})"
              if ran >= args.steps else
              f"  note: the script ended after {ran} optimizer step(s), before --steps {args.steps}")
    if runner.writes.written:
        print(_writes_note(runner.writes.written))
    for line in _write(report, args):
        print(line)
    if error is not None:
        if result.out_of_memory:
            print(result.oom_message(), file=sys.stderr)
        else:
            print(f"memmagic: the script failed: {type(error).__name__}: {error}"
                  + _data_hint(error), file=sys.stderr)
        if report.advice is not None:
            print(str(report.advice))
        return 1
    return 0 if report.fits is not False else 1


def _writes_note(paths: Sequence[str]) -> str:
    here = os.getcwd()
    shown = sorted({os.path.relpath(p, here) if p.startswith(here) else p for p in paths})
    more = f" and {len(shown) - 5} more" if len(shown) > 5 else ""
    return (f"  note: the script wrote {', '.join(shown[:5])}{more}: to a scratch directory, "
            "removed after the run (nothing was written to disk)")


def _whatif_knobs(items: Sequence[str]) -> dict[str, Any]:
    """``--whatif KNOB=VALUE`` options as the pipeline's knobs (an integer knob's value as a
    number); ValueError says what is wrong."""
    from .knobs import KNOBS

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


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("MPLBACKEND", "Agg")
    if args.command == "run":
        return run_script(args)
    return 2
