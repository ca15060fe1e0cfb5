"""The ``%%gpumem`` / ``%gpumem`` magic: argument parsing and rendering only."""

from __future__ import annotations

import argparse
import ast
import gc
import re
import sys
import textwrap
import traceback
from dataclasses import replace
from typing import Any, Iterator

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from .backends import BACKEND_NAMES, BackendUnavailable, cuda_usable, get_backend
from .failures import (NO_GPU_HINT, add_note_once, is_out_of_memory, needs_missing_cuda,
                       release_own_frames, strip_own_frames)
from .report import MemoryReport, format_bytes

__all__ = ["MemMagics"]

@magics_class
class MemMagics(Magics):
    """Holds the magic; the measuring happens in :mod:`memmagic.backends`."""

    @magic_arguments()
    @argument("--backend", choices=BACKEND_NAMES, default=None,
              help="Where to measure: cuda (real GPU allocator), cpu (real run on the CPU, "
                   "tensors tracked op by op), sim (simulated CUDA GPU on fake tensors, no GPU "
                   "needed; every sim cell of the notebook shares one simulated GPU), auto "
                   "(cuda when a GPU is usable, else cpu). Default: auto, or sim after "
                   "%%gpusim on.")
    @argument("--device", type=int, default=None, metavar="N",
              help="CUDA device index for --backend cuda (default: the current device).")
    @argument("--gpu", default=None, metavar="NAME",
              help="Target GPU for --backend sim, e.g. T4, A100-40GB, RTX4090, laptop-6GB: "
                   "the report says whether the cell fits.")
    @argument("--gpu-memory", default=None, metavar="SIZE",
              help="Target GPU memory for --backend sim, with a unit: 10GiB, 16GB, 512MiB "
                   "(at least 64 MiB). With --gpu it replaces the card's memory: --gpu T4 "
                   "--gpu-memory 6GiB simulates a T4 (its kernels) with 6 GiB, named "
                   "'T4 with 6.00 GiB' in the report, with a note.")
    @argument("--no-breakdown", action="store_true",
              help="cuda only: skip the per-category breakdown (lowest overhead).")
    @argument("--no-chart", action="store_true", help="Do not draw the breakdown chart.")
    @argument("-o", "--output", action="store_true",
              help="Return the MemoryReport (IPython shows it as the cell's result; the magic "
                   "then does not display it too).")
    @argument("-v", "--var", default=None, metavar="NAME",
              help="Store the MemoryReport in the variable NAME.")
    @argument("-q", "--quiet", action="store_true", help="Print nothing.")
    @argument("--no-raise", action="store_true",
              help="A cell that runs out of memory (real or simulated) shows its report as "
                   "the verdict and does not raise, so Run All goes on.")
    @argument("--footer", action="store_true",
              help="One line instead of the full report (what %%gpusim on uses).")
    @argument("--amp", default=None, metavar="{off,fp16,bf16}",
              help="What-if knob: autocast around each model call and its loss (fp16 with a "
                   "GradScaler), unless the cell reads the variable amp itself.")
    @argument("--batch-size", default=None, metavar="N",
              help="What-if knob: the (effective) batch size; the cell reads batch_size, or "
                   "memmagic resizes the batch tensors of the namespace the cell names.")
    @argument("--accum-steps", default=None, metavar="K",
              help="What-if knob: gradient accumulation over K micro-batches of "
                   "batch_size / K (the cell reads accum_steps, or memmagic repeats it per "
                   "micro-step with the optimizer step held back).")
    @argument("--checkpointing", nargs="?", const="on", default=None, metavar="MODULE",
              help="What-if knob: activation checkpointing of the model's repeated blocks "
                   "(children of a ModuleList/Sequential), or of the modules of class MODULE.")
    @argument("--weights-dtype", default=None, metavar="{fp32,bf16,fp16}",
              help="What-if knob: convert the model's weights (model.half()).")
    @argument("--grad-mode", default=None, metavar="{train,no_grad,inference_mode}",
              help="What-if knob: a training step, or a forward under no_grad / inference_mode.")
    @argument("--offload", action="store_true", default=None,
              help="What-if knob: keep tensors saved for backward on the CPU (save_on_cpu).")
    @argument("--optimizer", default=None, metavar="{sgd,sgd-momentum,adam,adamw,adafactor}",
              help="What-if knob: replace the optimizer the cell builds.")
    @argument("--inplace", action="store_true", default=None,
              help="What-if knob: inplace=True on activation and dropout modules.")
    @argument("--timeline", action="store_true",
              help="Also draw the memory over the run (op by op, with forward, backward and "
                   "optimizer phases marked); cpu and sim backends.")
    @argument("--snapshot", default=None, metavar="PATH",
              help="Write the run as a CUDA memory snapshot (pickle) that "
                   "https://pytorch.org/memory_viz opens; cpu and sim backends.")
    @argument("--whatif", action="store_true",
              help="Show a panel of controls for the knobs that apply to the cell; every change "
                   "re-runs the cell (on the simulated GPU unless --backend says otherwise) and "
                   "redraws the memory against the baseline. Needs ipywidgets 8.")
    @argument("--range", action="append", default=None, metavar="KNOB=LO:HI",
              help="The panel's range of an integer knob, e.g. batch_size=1:512.")
    @argument("--sweep", default=None, metavar="KNOB=LO:HI",
              help="Run the knob across the powers of two from LO to HI (or a list: "
                   "batch_size=8,16,32) for each strategy (AMP, checkpointing) and plot the "
                   "memory against it, with the largest value that fits the card.")
    @argument("--advise", action="store_true",
              help="The memory doctor: after the cell, who holds the memory it left (names, "
                   "the autograd graphs they pin, the classic leaks with their fix); after an "
                   "out of memory, the fixes ranked by re-running the cell with each on the "
                   "simulated GPU, and FSDP2 over 2, 4 and 8 GPUs. A failed cell gets the "
                   "doctor's short advice without it.")
    @argument("statement", nargs=argparse.REMAINDER,
              help="Line magic: the statement to measure.")
    @line_cell_magic
    def gpumem(self, line: str = "", cell: str | None = None) -> MemoryReport | None:
        """Measure what a cell (or one statement) does to GPU memory.

        Reports the peak, the memory left allocated (retained) and a breakdown at the peak
        into parameters, buffers, gradients, optimizer state, activations (tensors saved for
        backward) and other (inputs, outputs, temporaries). Sizes are bytes of tensor memory
        on the measured device; the CUDA context and other processes are never included.

        Examples::

            %%gpumem
            loss = model(x).sum(); loss.backward()

            %%gpumem --backend sim --gpu T4 -o
            ...code written for a GPU...

            %gpumem -v r y = model(x)
        """
        __tracebackhide__ = True
        try:
            args = parse_argstring(self.gpumem, line)
        except UsageError as exc:
            raise UsageError(f"{exc} (see %%gpumem? for the options)") from None
        source = " ".join(args.statement) if cell is None else cell
        if cell is not None and args.statement:
            raise UsageError(
                f"unexpected {' '.join(args.statement)!r} after %%gpumem: options start with '-', "
                "the code goes in the cell body")
        if not source.strip():
            raise UsageError("nothing to measure: use %gpumem STATEMENT or put code in a %%gpumem cell")
        if args.var is not None and not args.var.isidentifier():
            raise UsageError(f"-v needs a Python variable name, not {args.var!r}")
        knobs = self._knob_values(args)
        whatif = args.whatif or args.sweep is not None
        if whatif and cell is None:
            raise UsageError("--whatif and --sweep work on a %%gpumem cell, not a line")
        if whatif and args.backend is None:
            args.backend = "sim"  # re-runs are simulated unless asked otherwise
        backend = self._backend(args, persistent=not whatif)
        try:
            run = self._compile(source)
        except SyntaxError as exc:
            self._syntax_error(exc)
            return None
        if whatif or knobs or args.checkpoint_module:
            engine = self._cell(source, run, args, knobs, isolated=whatif)
            if args.sweep is not None:
                return self._sweep(engine, args)
            if args.whatif:
                return self._whatif(engine, args)
        before = self._doctor_snapshot(args)
        try:
            if knobs or args.checkpoint_module:
                outcome = engine.execute()
            else:
                outcome = backend.execute(run, self.shell.user_ns)
        except Exception as exc:
            from .backends.sim.errors import SimulationError
            from .knobs import KnobError

            if isinstance(exc, KnobError):
                raise UsageError(str(exc)) from None
            if not isinstance(exc, SimulationError):
                raise
            # refused before the cell ran (nested in a simulated cell, a card too small)
            raise UsageError(str(exc)) from None
        report = outcome.report
        error = outcome.error
        notes = list(self._notes(args, backend))
        if error is not None and backend.name != "sim" and needs_missing_cuda(error):
            notes.append("the cell needs a CUDA GPU, which this machine lacks: "
                         "--backend sim runs it on a simulated one")
            add_note_once(error, NO_GPU_HINT.format(how="--backend sim"))
        if notes:
            own = report.notes
            if any("replaced the" in n for n in notes):  # said with the option as typed
                own = tuple(n for n in own if not n.startswith("card size overridden"))
            report = replace(report, notes=own + tuple(notes))
        if error is not None:  # before the doctor reads the traceback's frames
            release_own_frames(error.__traceback__)
        advice = self._advise(args, source, run, report, error, before)
        if advice is not None:
            report = replace(report, advice=advice)
        if args.var:
            self.shell.user_ns[args.var] = report
        if error is None and outcome.value is not None and not args.quiet:
            display(outcome.value)
        if args.footer and not args.quiet:
            display(report.footer())
        elif not args.quiet:
            # with -o the returned report is the cell's result, which IPython shows
            self._render(report, chart=not args.no_chart,
                         show_report=not args.output or error is not None)
        extra = self._extras(report, args)
        if advice is not None and not args.quiet:
            display(advice)
        if error is not None:
            if is_out_of_memory(error):
                self._after_oom(error, report, quiet=args.quiet)
                if args.no_raise:
                    return report if args.output else None
            raise error.with_traceback(strip_own_frames(error.__traceback__, error))
        if extra is not None:
            raise UsageError(extra)
        return report if args.output else None

    def _extras(self, report: MemoryReport, args: argparse.Namespace) -> str | None:
        """--timeline and --snapshot; the one-line problem, if any (raised after the cell's
        own error, which comes first)."""
        problem = None
        if args.timeline and not args.quiet:
            from .plots import timeline_chart

            try:
                display(timeline_chart(report))
            except ValueError as exc:
                problem = f"--timeline: {exc}"
        if args.snapshot:
            from .snapshot import write_snapshot

            try:
                path = write_snapshot(report, args.snapshot)
            except (ValueError, OSError) as exc:
                problem = problem or f"--snapshot: {exc}"
            else:
                if not args.quiet:
                    print(f"memmagic: wrote {path} (open it at https://pytorch.org/memory_viz)")
        return problem

    # -- helpers -------------------------------------------------------------------------
    def _backend(self, args: argparse.Namespace, *, persistent: bool = True):
        name, options = self._backend_spec(args, persistent=persistent)
        try:
            return get_backend(name, **options)
        except (BackendUnavailable, ValueError, TypeError) as exc:
            raise UsageError(str(exc)) from None

    def _backend_spec(self, args: argparse.Namespace, *,
                      persistent: bool = True) -> tuple[str, dict[str, Any]]:
        """The backend's name and options; ``persistent``: a sim cell runs on the
        notebook's simulated GPU (what-if re-runs do not)."""
        from .simmode import sim_mode

        mode = sim_mode(self.shell)
        if args.backend is None:
            args.backend = "sim" if mode.on else "auto"
            if mode.on and not (args.gpu or args.gpu_memory):
                args.gpu, args.gpu_memory = mode.gpu, mode.gpu_memory
        name = args.backend
        if name != "sim" and (args.gpu or args.gpu_memory):
            raise UsageError("--gpu and --gpu-memory pick a target for the simulation: add --backend sim")
        real_cuda = name == "cuda" or (name == "auto" and cuda_usable())
        if args.device is not None and not real_cuda:
            raise UsageError("--device picks a CUDA device: use it with --backend cuda on a GPU machine")
        options: dict[str, Any] = {}
        if name == "sim" and (args.gpu or args.gpu_memory):
            from .backends.sim.gpus import option_spelling, resolve_target

            try:  # errors name the options as typed here
                options["gpu"] = resolve_target(args.gpu, args.gpu_memory,
                                                spell=option_spelling)
            except (ValueError, TypeError) as exc:
                raise UsageError(str(exc)) from None
        if name == "sim":
            from .backends.sim.session import shell_session

            # one simulated GPU per notebook; what-if re-runs start from a copy of it
            options["session" if persistent else "start_from"] = shell_session(self.shell)
        if real_cuda:
            if args.device is not None:
                options["device"] = args.device
            if args.no_breakdown:
                options["breakdown"] = False
        elif args.no_breakdown:
            raise UsageError("--no-breakdown applies to --backend cuda only")
        return name, options

    # -- what-if ----------------------------------------------------------------------------
    @staticmethod
    def _knob_values(args: argparse.Namespace) -> dict[str, Any]:
        """The knob options given on the line, checked (UsageError naming the option)."""
        from .knobs import KNOBS, KnobError

        raw = {"amp": args.amp, "batch_size": args.batch_size, "accum_steps": args.accum_steps,
               "weights_dtype": args.weights_dtype, "grad_mode": args.grad_mode,
               "offload": args.offload, "optimizer": args.optimizer, "inplace": args.inplace}
        args.checkpoint_module = None
        ck = args.checkpointing
        if ck is not None:
            low = ck.lower()
            if low in ("on", "true", "yes", "1", "off", "false", "no", "0"):
                raw["checkpointing"] = low in ("on", "true", "yes", "1")
            elif ck.isidentifier():
                raw["checkpointing"] = True
                args.checkpoint_module = ck
            else:
                raise UsageError(f"--checkpointing takes on, off or a module class name "
                                 f"(TransformerBlock), not {ck!r}")
        values = {}
        for name, value in raw.items():
            if value is None:
                continue
            try:
                values[name] = KNOBS[name].check(value)
            except KnobError as exc:
                raise UsageError(f"--{name.replace('_', '-')}: {exc}") from None
        return values

    def _cell(self, source: str, run, args: argparse.Namespace, knobs: dict[str, Any], *,
              isolated: bool, leave_out: tuple[str, ...] = ()):
        """The what-if engine for this cell: the magic's knob options are its baseline
        (``leave_out``: names whose simulated objects its re-runs start without)."""
        from .cell import Cell
        from .knobs import KnobError, Setting

        name, options = self._backend_spec(args, persistent=not isolated)
        if leave_out and "start_from" in options:
            options["leave_out"] = leave_out
        defaults = dict(knobs)
        if isolated and name == "sim" and args.gpu and not args.gpu_memory:
            try:
                Setting(gpu=args.gpu)
            except KnobError:
                pass
            else:
                defaults["gpu"] = args.gpu
                options.pop("gpu", None)
        try:
            return Cell(source, self.shell.user_ns, backend=name, backend_options=options,
                        defaults=defaults, isolated=isolated, compile=lambda _src: run,
                        checkpoint_module=args.checkpoint_module)
        except (KnobError, ValueError, TypeError) as exc:
            raise UsageError(str(exc)) from None

    def _whatif(self, engine, args: argparse.Namespace):
        from .widgets import WhatIfPanel, parse_ranges

        if "batch_size" in engine.reads and engine.baseline.batch_size is None:
            raise UsageError("the cell reads batch_size: give its starting value with "
                             "--batch-size N (or define batch_size in an earlier cell)")
        try:
            ranges = parse_ranges(args.range or [])
            panel = WhatIfPanel(engine, ranges=ranges)
        except (ImportError, ValueError) as exc:  # no ipywidgets; a bad range or setting
            raise UsageError(str(exc)) from None
        if args.var:
            self.shell.user_ns[args.var] = panel
        if args.output:
            return panel
        if not args.quiet:
            display(panel)
        return None

    def _sweep(self, engine, args: argparse.Namespace):
        from .sweep import parse_values, sweep

        knob, _, values = args.sweep.partition("=")
        try:
            if not values:
                raise ValueError("--sweep takes KNOB=LO:HI, e.g. --sweep batch_size=1:512")
            result = sweep(engine, knob.strip(), parse_values(values, knob.strip()))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if args.var:
            self.shell.user_ns[args.var] = result
        if not args.quiet:
            if not args.no_chart:
                display(result.chart())
            if not args.output:
                display(result)
        return result if args.output else None

    @staticmethod
    def _notes(args: argparse.Namespace, backend) -> Iterator[str]:
        """Notes on what the options made of the run."""
        if args.backend == "auto" and backend.name == "cpu":
            yield ("auto picked the cpu backend: no usable CUDA GPU here "
                   "(use --backend sim to predict what a GPU would use)")
        target = getattr(backend, "target", None)
        card = getattr(target, "resized_from", None)
        if args.gpu and args.gpu_memory and card is not None:
            yield (f"--gpu-memory {args.gpu_memory} replaced the {card.name}'s "
                   f"{format_bytes(card.total_memory)}: simulated as {target.name}, "
                   f"with the {card.name}'s kernels")

    def _syntax_error(self, error: SyntaxError) -> None:
        """Show a cell's syntax error as IPython shows one (no traceback), and fail the cell."""
        self.shell.showsyntaxerror()
        result = getattr(self.shell.displayhook, "exec_result", None)  # the running cell's
        if result is not None and result.error_in_exec is None:
            result.error_in_exec = error  # "Run All" stops here, as at any syntax error

    def _compile(self, source: str):
        """The cell as a function of the namespace; raises SyntaxError before running any."""
        from .simmode import suspended

        shell = self.shell
        with suspended(shell):  # the body is not wrapped again by %gpusim's transformer
            transformed = shell.transform_cell(source)
        # IPython counts the running cell already: its number is one less
        filename = shell.compile.cache(transformed, max(shell.execution_count - 1, 0))
        tree = shell.transform_ast(shell.compile.ast_parse(transformed, filename=filename))
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        body = shell.compile(tree, filename, "exec")
        tail = shell.compile(last, filename, "eval") if last is not None else None

        def run(ns: dict) -> Any:
            __tracebackhide__ = True
            exec(body, ns)
            return eval(tail, ns) if tail is not None else None

        return run

    def _render(self, report: MemoryReport, *, chart: bool, show_report: bool = True) -> None:
        if show_report:
            display(report)
        if chart and getattr(self.shell, "kernel", None) is not None:
            from .plots import breakdown_chart

            display(breakdown_chart(report))

    # -- the memory doctor ----------------------------------------------------------------
    def _doctor_view(self, args: argparse.Namespace) -> dict:
        """The namespace as the doctor walks it (simulated objects of the notebook's GPU
        stand for their placeholders)."""
        from . import doctor

        session = None
        if args.backend == "sim":
            from .backends.sim.session import shell_session

            session = shell_session(self.shell)
        return doctor.namespace_view(self.shell.user_ns, session)

    def _doctor_snapshot(self, args: argparse.Namespace):
        """What the namespace holds before the cell (--advise lists what the cell left)."""
        if not args.advise:
            return None
        from . import doctor

        return doctor.snapshot(self._doctor_view(args))

    def _advise(self, args: argparse.Namespace, source: str, run, report: MemoryReport,
                error: BaseException | None, before) -> Any:
        """The doctor's advice: with --advise always; after a failed cell, the short one (an
        out of memory on the simulated GPU is ranked too: its re-runs are cheap)."""
        if error is None and not args.advise:
            return None
        from . import doctor

        try:
            view = self._doctor_view(args)
            if error is None:
                return doctor.advise(view, report=report, since=before)
            if not is_out_of_memory(error):
                return doctor.advise(view, report=report, error=error)
            cell = None
            if args.advise or args.backend == "sim":
                sim_args = argparse.Namespace(**vars(args))
                if args.backend != "sim":  # rank on a simulated card of the real one's size
                    sim_args.backend, sim_args.gpu = "sim", None
                    sim_args.gpu_memory = self._real_card_memory(args)
                # rank the fixes from the state before the cell ran: what it bound before
                # failing (a model it builds) stays out of the copy of the simulated GPU
                from .cell import _names

                cell = self._cell(source, run, sim_args, {}, isolated=True,
                                  leave_out=tuple(sorted(_names(source)[1])))
            return doctor.advise(view, report=report, error=error, cell=cell,
                                 strategies=cell is not None,
                                 world_sizes=(2, 4, 8) if args.advise else ())
        except UsageError:
            return None
        except Exception as exc:  # the doctor never hides the cell's own outcome
            print(f"memmagic: the memory doctor could not advise on this cell "
                  f"({type(exc).__name__}: {exc})", file=sys.stderr)
            return None

    @staticmethod
    def _real_card_memory(args: argparse.Namespace) -> str | None:
        import torch

        try:
            if torch.cuda.is_available():
                dev = args.device if args.device is not None else torch.cuda.current_device()
                return str(torch.cuda.get_device_properties(dev).total_memory)
        except Exception:
            pass
        return None

    @staticmethod
    def _after_oom(error: BaseException, report: MemoryReport, *, quiet: bool) -> None:
        """Free what the failed cell's frames hold so the next cell can run, and say so."""
        from . import doctor

        doctor.release_failed_cell(error)  # clears the frames (and f_locals snapshots)
        traceback.clear_frames(error.__traceback__)
        gc.collect()
        if quiet:
            return
        from .failures import requested_text

        requested = requested_text(error) or "an unknown amount"
        text = (f"memmagic: out of memory on {report.device}: tried to allocate {requested} "
                f"while {format_bytes(report.after)} of tensors were live (peak "
                f"{format_bytes(report.peak)}). The failed cell's local variables were released.")
        # short lines: front ends wrap a long stderr line anywhere, mid-word included
        print(textwrap.fill(text, 78, break_long_words=False, break_on_hyphens=False),
              file=sys.stderr)
