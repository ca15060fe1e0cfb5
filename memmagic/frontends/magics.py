"""The ``%%gpumem`` / ``%gpumem`` magic: parse the line, call the pipeline, display.

Like ``%timeit`` over ``TimeitResult``: everything between the line and the report is
:mod:`memmagic.pipeline`. The options are the base ones below plus one per knob of
:data:`memmagic.whatif.knobs.KNOBS`, built from the knobs' entries.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, construct_parser, parse_argstring
from IPython.display import display

from ..whatif.knobs import BATCH_DIM, KNOBS, resizing
from .options import OPTIONS, check_options, line_problem, unquote, views
from ..jobs import run_job
from ..pipeline import CellRequest, RequestError, make_cell
from ..report import MemoryReport

__all__ = ["MemMagics"]
_AS_GIVEN = ("world_size", "rank", "gpus_per_node", "decode_steps", "max_seconds")


def _with_options(func):
    """(Re)build the magic's parser from the base options and the knobs of KNOBS now."""
    before, after = OPTIONS
    knobs = [k.argument() for k in KNOBS.values() if k.option is not None]
    func.has_arguments = True
    func.decorators = [argument(*flags, **kw) for flags, kw in reversed(before + knobs + after)]
    func.__doc__ = func.magic_doc
    func.parser = construct_parser(func)
    func.knob_names = tuple(KNOBS)
    return func


def _silenced(source: str) -> bool:
    """Whether the cell ends with ``;``, which silences its value (as IPython does)."""
    import tokenize

    from IPython.core.displayhook import DisplayHook

    try:
        return bool(DisplayHook.semicolon_at_end_of_expression(source))
    except (SyntaxError, tokenize.TokenError):  # what tokenize says of an unfinished line
        return False


@magics_class
class MemMagics(Magics):
    """Holds the magic; the measuring happens in :mod:`memmagic.pipeline`."""

    @line_cell_magic
    def gpumem(self, line: str = "", cell: str | None = None) -> MemoryReport | None:
        """Measure what a cell (or one statement) does to GPU memory.

        Reports the peak, the memory left allocated (retained) and a breakdown at the peak
        into parameters, buffers, gradients, optimizer state, activations (tensors saved for
        backward) and other (inputs, outputs, temporaries). Sizes are bytes of tensor memory
        on the measured device; the CUDA context and other processes are never included in
        them (on a named simulated card the verdict "fits" adds a published figure for the
        context, said in a note).

        Examples::

            %%gpumem
            loss = model(x).sum(); loss.backward()

            %%gpumem --backend sim --gpu T4 -o
            ...code written for a GPU...

            %gpumem -v r y = model(x)
        """
        __tracebackhide__ = True
        args = self._parse(line, cell)
        source = cell if cell is not None else " ".join(args.statement)
        run = self._compile(source)
        if run is None:  # a syntax error, shown as IPython shows one
            return None
        request = self._request(args, source, run)
        try:
            if views(args):
                return self._whatif(make_cell(request, isolated=True), args)
            result = run_job(request, args.job)
        except RequestError as exc:
            raise UsageError(str(exc)) from None
        report, error = result.report, result.error
        if args.var:
            self.shell.user_ns[args.var] = report
        if not args.quiet:
            self._show(result, args, source)
        problem = self._extras(report, args)
        if report.advice is not None and not args.quiet:
            display(report.advice)
        if error is not None:
            if result.out_of_memory:
                if not args.quiet:  # short lines: front ends wrap a long one mid-word
                    print(textwrap.fill(result.oom_message(), 78, break_long_words=False,
                                        break_on_hyphens=False), file=sys.stderr)
                if args.no_raise:
                    return report if args.output else None
            raise error
        if problem is not None:
            raise UsageError(problem)
        return report if args.output else None

    # -- the line --------------------------------------------------------------------------
    def _parse(self, line: str, cell: str | None) -> argparse.Namespace:
        func = MemMagics.gpumem
        if func.knob_names != tuple(KNOBS):  # a knob was added since: its option too
            _with_options(func)
        try:
            args = check_options(unquote(parse_argstring(func, line)))
        except UsageError as exc:
            raise UsageError(f"{exc} (see %%gpumem? for the options)") from None
        except ValueError as exc:  # a quote left open (shlex); --gpu "", --whatif --sweep
            raise UsageError(line_problem(exc)) from None
        if cell is not None and args.statement:
            raise UsageError(
                f"unexpected {' '.join(args.statement)!r} after %%gpumem: options start with '-', "
                "the code goes in the cell body")
        source = " ".join(args.statement) if cell is None else cell
        if not source.strip():
            raise UsageError("nothing to measure: use %gpumem STATEMENT or put code in a %%gpumem cell")
        if args.var is not None and not args.var.isidentifier():
            raise UsageError(f"-v needs a Python variable name, not {args.var!r}")
        if views(args) and cell is None:
            raise UsageError("--whatif, --sweep and --fitmap work on a %%gpumem cell, not a line")
        return args

    def _request(self, args: argparse.Namespace, source: str, run) -> CellRequest:
        """The pipeline's request: the line's options, %gpusim's defaults, the compiled cell."""
        from .simmode import sim_mode

        mode = sim_mode(self.shell)
        backend, gpu, gpu_memory = args.backend, args.gpu, args.gpu_memory
        if backend is None:  # re-runs are simulated unless asked otherwise
            whatif = views(args)
            backend = "sim" if mode.on or whatif or args.world_size is not None else "auto"
            if mode.on and not (gpu or gpu_memory):  # the notebook's card
                gpu, gpu_memory = mode.gpu, mode.gpu_memory
        session = None
        if backend == "sim" or args.advise:
            from ..backends.sim import shell_session

            session = shell_session(self.shell)  # one simulated GPU per notebook
        knobs = {k.name: getattr(args, k.name) for k in KNOBS.values() if k.option is not None}
        return CellRequest(source, self.shell.user_ns, backend=backend, gpu=gpu,
                           gpu_memory=gpu_memory, device=args.device,
                           breakdown=not args.no_breakdown, session=session,
                           knobs={k: v for k, v in knobs.items() if v is not None},
                           advise=args.advise, run=run, **{k: getattr(args, k) for k in _AS_GIVEN})

    def _compile(self, source: str):
        """``run(ns)`` of the cell, IPython's transforms on; a syntax error fails it as in IPython."""
        from ..whatif.engine import compile_cell
        from .simmode import suspended

        shell = self.shell
        with suspended(shell):  # the body is not wrapped again by %gpusim's transformer
            transformed = shell.transform_cell(source)
        # IPython counts the running cell already: its number is one less
        filename = shell.compile.cache(transformed, max(shell.execution_count - 1, 0))
        try:
            return compile_cell(transformed, filename=filename, parse=shell.compile.ast_parse,
                                transform=shell.transform_ast, compiler=shell.compile,
                                recompile=self._compile)
        except SyntaxError as exc:
            shell.showsyntaxerror()
            result = getattr(shell.displayhook, "exec_result", None)  # the running cell's
            if result is not None and result.error_in_exec is None:
                result.error_in_exec = exc  # "Run All" stops here, as at any syntax error
            return None

    # -- display ---------------------------------------------------------------------------
    def _show(self, result, args: argparse.Namespace, source: str) -> None:
        report = result.report
        if result.error is None and result.value is not None and not _silenced(source):
            display(result.value)
        if args.footer:
            display(report.footer())
        else:
            # with -o the returned report is the cell's result, which IPython shows
            if not args.output or result.error is not None:
                display(report)
            if not args.no_chart and getattr(self.shell, "kernel", None) is not None:
                from ..charts.plots import breakdown_chart

                display(breakdown_chart(report))

    def _extras(self, report: MemoryReport, args: argparse.Namespace) -> str | None:
        """--timeline and --snapshot; the one-line problem, if any (raised after the cell's
        own error, which comes first)."""
        problem = None
        if args.timeline and not args.quiet:
            from ..charts.plots import timeline_chart

            try:
                display(timeline_chart(report))
            except ValueError as exc:
                problem = f"--timeline: {exc}"
        if args.snapshot:
            from ..core.snapshot import write_snapshot

            try:
                path = write_snapshot(report, args.snapshot)
            except (ValueError, OSError) as exc:
                problem = problem or f"--snapshot: {exc}"
            else:
                if not args.quiet:
                    print(f"memmagic: wrote {path} (open it at https://pytorch.org/memory_viz)")
        return problem

    def _whatif(self, engine, args: argparse.Namespace) -> Any:
        """--whatif: the panel; --sweep: the sweep and its chart; --fitmap: the fit map."""
        from ..whatif.fitmap import run_fitmap_option
        from ..whatif.sweeps import run_sweep_option
        from .widgets import WhatIfPanel, parse_ranges

        try:
            if args.fitmap is not None:
                shown = run_fitmap_option(engine, args.fitmap)
            elif args.sweep is not None:
                shown = run_sweep_option(engine, args.sweep)
            else:
                batch = resizing(BATCH_DIM)
                if batch.var in engine.reads and engine.baseline.effective_batch is None:
                    raise ValueError(f"the cell reads {batch.var}: give its starting value with "
                                     f"{batch.flag} N (or define {batch.var} in an earlier cell)")
                shown = WhatIfPanel(engine, ranges=parse_ranges(args.range or []))
        except (ImportError, ValueError) as exc:  # no ipywidgets; a bad range, sweep or setting
            raise UsageError(str(exc)) from None
        if args.var:
            self.shell.user_ns[args.var] = shown
        if not args.quiet:
            if (args.sweep is not None or args.fitmap is not None) and not args.no_chart:
                display(shown.chart())
            if not args.output:
                display(shown)
        return shown if args.output else None


MemMagics.gpumem.magic_doc = MemMagics.gpumem.__doc__
_with_options(MemMagics.gpumem)
