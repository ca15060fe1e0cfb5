"""The what-if panel (``%%gpumem --whatif``): controls for the knobs that apply to a cell,
and the memory redrawn against the baseline on every change.

Everything is drawn through widget state, never ``with out:`` (which nbval does not
emulate): the chart as SVG markup (:mod:`memmagic.charts.svg`) and the numbers as HTML in
``ipywidgets.HTML`` values, so a change sends a few kilobytes of text in a few
milliseconds; the sweep's chart (on a click) as PNG bytes into an ``ipywidgets.Image``.
The panel's text repr is one deterministic line with the current setting and peak; its
``text/html`` (for a front end without widgets: a saved notebook on GitHub) is the chart
and the numbers as they stood when it was displayed. ipywidgets is imported only when a panel is built;
without it the error says what to install.
"""

from __future__ import annotations

import contextlib
import html
import time
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

from ..whatif.evaluated import evaluate, remember
from ..whatif.knobs import KNOBS, KnobError, Setting, panel_sweep
from ..report import MemoryReport, format_bytes

if TYPE_CHECKING:
    from ..whatif.engine import Cell
    from ..whatif.fitmap import FitMap
    from ..whatif.sweeps import Sweep

__all__ = ["WhatIfPanel", "parse_ranges", "INSTALL_HINT"]

INSTALL_HINT = ("the what-if panel needs ipywidgets 8: pip install 'ipywidgets>=8' "
                "(the knob options --amp, --batch-size, --accum-steps, --checkpointing, ... "
                "work without it)")
_CACHE = 32
_LABEL_WIDTH = "12em"  # the column of knob names (the longest, "accumulation steps", on one line)
_PANEL_DPI = 120  # the sweep's chart: sharp enough, and fast to draw


def _ipywidgets():
    try:
        import ipywidgets
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    major = int(str(getattr(ipywidgets, "__version__", "0")).split(".")[0] or 0)
    if major < 8:
        raise ImportError(f"{INSTALL_HINT}; ipywidgets {ipywidgets.__version__} is installed")
    return ipywidgets


def parse_ranges(items: Iterable[str]) -> dict[str, tuple[int, int]]:
    """``["batch_size=1:512"]`` -> ``{"batch_size": (1, 512)}`` (integer knobs only)."""
    out: dict[str, tuple[int, int]] = {}
    for item in items:
        name, _, span = str(item).partition("=")
        name = name.strip().replace("-", "_")
        knob = KNOBS.get(name)
        if knob is None or knob.kind != "int":
            ints = ", ".join(n for n, k in KNOBS.items() if k.kind == "int")
            raise ValueError(f"--range takes an integer knob ({ints}) as KNOB=LO:HI, not {item!r}")
        lo_s, _, hi_s = span.partition(":")
        try:
            lo, hi = knob.check(lo_s), knob.check(hi_s)
        except KnobError:
            raise ValueError(f"--range {name}=LO:HI needs two whole numbers, not {span!r}") from None
        if hi < lo:
            raise ValueError(f"--range {name}: {lo} is above {hi}")
        out[name] = (lo, hi)
    return out


def _powers(lo: int, hi: int, extra: int | None = None) -> list[int]:
    vals = {v for v in (1 << i for i in range(31)) if lo <= v <= hi} | {lo, hi}
    if extra is not None:
        vals.add(extra)
    return sorted(vals)


class WhatIfPanel:
    """Controls for every knob that applies to ``cell`` (judged from its baseline run), a
    chart of the baseline and the current setting side by side, and the numbers.

    Setting a control's ``value`` re-runs the cell (after ``debounce_s`` when an event
    loop runs, as in a kernel; at once otherwise) and updates the panel in place.
    ``panel.setting``, ``panel.report`` and ``panel.baseline_report`` hold what is
    shown; ``panel.error`` the last re-run's error (None when it ran).

    With ``evaluate`` (and ``cache``), a batch size or context length that earlier runs
    of this panel answer is read off them instead of run
    (:func:`memmagic.whatif.evaluated.evaluate`: runs differing only in that size, on one
    line or parabola, checked by one they were not drawn through): the panel says so, and
    ``panel.evaluated`` counts them."""

    def __init__(self, cell: "Cell", *, ranges: Mapping[str, tuple[int, int]] | None = None,
                 debounce_s: float = 0.15, cache: bool = True, evaluate: bool = True) -> None:
        w = _ipywidgets()
        self.cell = cell
        self.debounce_s = float(debounce_s)
        self.cache_enabled = bool(cache)
        self.evaluate = bool(evaluate)
        self._planes: dict = {}  # the lines evaluate() found among the cached runs
        self._cache: OrderedDict[Setting, MemoryReport] = OrderedDict()
        self._pending = None
        self.ranges = dict(ranges or {})
        self.baseline: Setting = cell.setting()
        self.runs, self.evaluated = 0, 0  # the panel's runs of the cell, and answers read off them
        self.baseline_report = self._report(self.baseline)
        self._fall_back()
        cell = self.cell
        self.knobs: list[str] = cell.applicable()
        self.setting: Setting = self.baseline
        self.report: MemoryReport = self.baseline_report
        self.error: str | None = self.baseline_report.error
        self.last_update_s: float | None = None
        self.sweep_result: "Sweep | None" = None
        self.fit_map_result: "FitMap | None" = None
        self.controls: dict[str, Any] = {}
        for name in self.knobs:
            ctl = self._control(w, name)
            if ctl is not None:
                self.controls[name] = ctl
                ctl.observe(self._changed, names="value")
        self.chart = w.HTML(layout=w.Layout(max_width="100%"))
        self.text = w.HTML()
        self.status = w.HTML()
        swept = panel_sweep()
        what = swept.label if swept is not None else "a knob"
        self.sweep_button = w.Button(description=f"sweep {what}",
                                     tooltip=f"run the {what} across its range for AMP and "
                                             "checkpointing on and off")
        self.sweep_button.on_click(lambda _b: self.run_sweep())
        # hidden until a sweep has run (an empty Image shows as a broken-image icon)
        self.sweep_image = w.Image(format="png", layout=w.Layout(max_width="100%", display="none"))
        self.sweep_text = w.HTML()
        self.fit_map_button = w.Button(description="fit map", tooltip=(
            "which pairs of batch size and context length fit the target card, over the "
            "sliders' ranges (read off four or six runs, checked by runs)"))
        self.fit_map_button.on_click(lambda _b: self.run_fit_map())
        # one row per knob: its name in a right-aligned column, then the control, so that
        # sliders, toggle buttons, checkboxes and menus line up
        rows = [self._row(w, KNOBS[name].label, ctl) for name, ctl in self.controls.items()]
        if swept is not None and swept.name in self.controls:
            rows.append(self._row(w, "", self.sweep_button))
        if self._plane_knobs() is not None:
            rows.append(self._row(w, "", self.fit_map_button))
        self.box = w.VBox([w.VBox(rows), self.status, self.chart, self.text,
                           self.sweep_image, self.sweep_text])
        self._draw()

    # -- controls ---------------------------------------------------------------------------
    @staticmethod
    def _row(w, label: str, control):
        name = w.HTML(f"<div class='memmagic-knob' style='text-align:right;padding-right:0.8em;"
                      "white-space:nowrap;overflow:hidden;text-overflow:ellipsis;"
                      f"line-height:var(--jp-widgets-inline-height, 28px)'>{html.escape(label)}"
                      "</div>", layout=w.Layout(width=_LABEL_WIDTH, min_width=_LABEL_WIDTH))
        row = w.HBox([name, control], layout=w.Layout(align_items="center"))
        row.add_class("memmagic-row")
        return row

    def _control(self, w, name: str):
        """The control of one knob, as its entry says (``Knob.panel``); None: no control."""
        knob = KNOBS[name]
        value = getattr(self.baseline, name)
        # the name is in the row's label column (see _row); the tooltip repeats it
        common = dict(description="", tooltip=knob.label)
        # wide enough for the longest choice ("inference_mode")
        buttons = dict(style={"button_width": "9.5em"}, layout=w.Layout(width="auto"), **common)
        if knob.panel is None:
            return None
        widget = knob.panel.widget
        if knob.kind == "int":
            if value is None:
                return None
            opts = _powers(*self.ranges.get(name, knob.span(value)), value)
            if widget == "buttons":
                return w.ToggleButtons(options=opts, value=value, **buttons)
            return w.SelectionSlider(options=opts, value=value, continuous_update=False,
                                     layout=w.Layout(width="30em"), **common)
        if knob.kind == "bool":
            return w.Checkbox(value=bool(value), indent=False, layout=w.Layout(width="auto"),
                              **common)
        opts = [(str(c), c) for c in knob.values()]
        if knob.default is None:
            opts.insert(0, (knob.panel.unset_label, _UNSET))
        if widget == "buttons" and len(opts) <= 4:
            return w.ToggleButtons(options=opts, value=_shown(value), **buttons)
        return w.Dropdown(options=opts, value=_shown(value), layout=w.Layout(width="16em"),
                          **common)

    def current(self) -> Setting:
        """The setting the controls show."""
        values = self.baseline.changed()
        for name, ctl in self.controls.items():
            values[name] = None if ctl.value == _UNSET else ctl.value
        return Setting(**values)

    def set(self, **values: Any) -> None:
        """Move controls (as a user would) and update once: ``panel.set(amp="fp16")``. A
        whole number off a slider's marks joins its marks (``batch_size=4096``). A setting
        that does not fit the card is an answer (``panel.report`` says so); one that cannot
        run puts the controls back and raises ValueError saying why."""
        unknown = set(values) - set(self.controls)
        if unknown:
            raise ValueError(f"no control for {', '.join(sorted(unknown))} on this panel; it has "
                             f"{', '.join(self.controls)}")
        # every value checked before any control moves
        values = {name: self._check_choice(name, v) for name, v in values.items()}
        for name, v in values.items():
            self._mark(name, v)
        self._move({name: v if KNOBS[name].kind == "int" else _shown(v)
                    for name, v in values.items()})
        self.update()
        if self.error is not None:
            raise ValueError(f"panel.set({', '.join(f'{k}={v!r}' for k, v in values.items())}): "
                             f"{_short(self.error)}")

    def _check_choice(self, name: str, value: Any) -> Any:
        """``value`` as its control offers it (a card by another of its names, ``"H100"``);
        one a choice control (buttons, a checkbox, a dropdown) does not offer: ValueError in
        one line, naming the values it offers."""
        knob = KNOBS[name]
        if knob.kind == "int":
            return value
        offered = ([False, True] if knob.kind == "bool" else
                   [o[1] if isinstance(o, tuple) else o for o in self.controls[name].options])
        try:
            value = knob.check(value)  # (normalised as the knob takes it: "on", "FP16")
        except KnobError:
            pass
        if _shown(value) not in offered:
            shown = ", ".join(repr(o) for o in offered if o is not _UNSET)
            raise ValueError(f"panel.set({name}={value!r}): not one of the values this control "
                             f"offers ({shown})")
        return value

    def _mark(self, name: str, value: Any) -> None:
        """Add a whole-number knob's value to its control's marks (checked as the knob
        checks it: ValueError in one line)."""
        knob, ctl = KNOBS[name], self.controls[name]
        if knob.kind != "int" or value in ctl.options:
            return
        try:
            value = knob.check(value)
        except KnobError as exc:
            raise ValueError(str(exc)) from None
        shown = ctl.value
        with self._quiet(), ctl.hold_trait_notifications():
            ctl.options = tuple(sorted({*ctl.options, value}))
            ctl.value = shown

    def _move(self, values: Mapping[str, Any]) -> None:
        """Set controls' values without a re-run per control."""
        with self._quiet():
            for name, v in values.items():
                ctl = self.controls[name]
                with ctl.hold_trait_notifications():
                    ctl.value = v

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """Controls changed by the panel itself: no re-run per change."""
        pending, self.debounce_s = self.debounce_s, -1.0
        try:
            yield
        finally:
            self.debounce_s = pending

    # -- updating ------------------------------------------------------------------------------
    def _changed(self, change: dict) -> None:
        if self.debounce_s < 0:
            return  # set() updates once at the end
        loop = _running_loop()
        if self.debounce_s == 0 or loop is None:
            self.update()
            return
        if self._pending is not None:
            self._pending.cancel()
        self.status.value = "<i>re-running…</i>"
        self._pending = loop.call_later(self.debounce_s, self.update)

    def update(self) -> None:
        """Re-run the cell with the controls' setting and redraw. A setting that runs out
        of memory is shown as the answer (does not fit, the breakdown when it ran out); one
        that cannot run shows why, with the controls back at the last setting that ran."""
        self._pending = None
        t0 = time.perf_counter()
        setting = self.current()
        try:
            setting.check_batch()
            report = self._report(setting)
        except Exception as exc:  # noqa: BLE001 - a re-run's error shows in the panel
            self._refused(setting, f"{type(exc).__name__}: {exc}")
        else:
            if report.error is not None and report.failed_request is None:
                self._refused(setting, report.error)
            else:  # it ran, or ran out of memory: either is the answer
                self.error = None
                self.setting, self.report = setting, report
                self._draw()
        self.last_update_s = time.perf_counter() - t0

    def _refused(self, tried: Setting, error: str) -> None:
        """A setting that could not run: say why; the controls go back to the setting the
        chart shows."""
        self.error = error
        self._draw_status(tried)
        shown = self.setting
        self._move({name: getattr(shown, name) if KNOBS[name].kind == "int"
                    else _shown(getattr(shown, name)) for name in self.controls})

    def _fall_back(self) -> None:
        """A cell that fails as written with the knob variables it reads set to a setting's
        values (``autocast(enabled=amp)`` with a variable of its own kind) gets its knobs
        applied by memmagic instead, so that the panel works; its notes say so."""
        r = self.baseline_report
        # the knobs that size the data take whole numbers: no variable of the cell's own kind
        handled = {k.var for k in KNOBS.values() if k.sizes is None}
        if r.error is None or r.failed_request is not None or not self.cell.reads & handled:
            return
        other = self.cell.applying_knobs(f"the cell failed with its own variables ({r.error})")
        baseline = other.setting()
        report = other.run(baseline)
        if report.error is None or report.failed_request is not None:
            self.cell, self.baseline, self.baseline_report = other, baseline, report
            self._cache.clear()

    def _report(self, setting: Setting) -> MemoryReport:
        if self.cache_enabled and setting in self._cache:
            self._cache.move_to_end(setting)
            return self._cache[setting]
        report = (evaluate(self._cache, setting, self._planes)
                  if self.evaluate and self.cache_enabled else None)
        if report is None:
            report = self.cell.run(setting)
            self.runs += 1
            if report.failed_request is not None and self.evaluate and self.cache_enabled:
                # ran out of memory: what the whole step needs, off the line it checks
                whole = evaluate({**self._cache, setting: report}, setting, self._planes)
                report = report if whole is None else replace(whole, stopped=report)
        else:
            self.evaluated += 1
        if self.cache_enabled:
            self._cache[setting] = report
            while len(self._cache) > _CACHE:
                self._cache.popitem(last=False)
            if self.evaluate and not report.interpolated:
                remember(self._cache, setting, self._planes)
        return report

    # -- drawing ---------------------------------------------------------------------------------
    def _draw(self) -> None:
        from ..charts.svg import comparison_svg

        reports = [self.baseline_report]
        labels = [f"baseline\n{_wrap(self.baseline.label())}"]
        if self.setting != self.baseline:
            reports.append(self.report)
            ran_out = "\n(when it ran out)" if self.report.failed_request is not None else ""
            how = "\n(evaluated, not run)" if self.report.interpolated else ""
            labels.append(f"now\n{_wrap(self.setting.label())}{ran_out}{how}")
        self.chart.value = comparison_svg(reports, labels)
        self.text.value = self._html()
        self._draw_status()

    def _draw_status(self, tried_setting: Setting | None = None) -> None:
        if self.error is None:
            r = self.report
            why = (_out_of_memory(r) if r.failed_request is not None
                   else f"needs {format_bytes(r.card_need)} of its {format_bytes(r.gpu_memory)} "
                        "(evaluated)" if r.interpolated and r.fits is False else None)
            self.status.value = "" if why is None else (
                "<div style='color:var(--jp-warn-color1, #b45309)'>"
                f"<b>does not fit</b> {html.escape(r.gpu_name or 'the GPU')}: "
                f"{html.escape(why)}</div>")
            return
        tried = (tried_setting or self.current()).label()
        self.status.value = (
            "<div style='color:var(--jp-error-color1, var(--vscode-errorForeground, #c62828))'>"
            f"<b>re-run failed</b> ({html.escape(tried)}): {html.escape(_short(self.error))}"
            "<br><span style='opacity:0.8'>the controls are back at the last setting that ran, "
            "which the chart shows</span></div>")

    def _html(self) -> str:
        b, r = self.baseline_report, self.report
        s = self.setting
        rows = [("setting", s.label())]
        if s.effective_batch is not None:
            k = s.micro_steps
            rows.append(("batch", f"effective {s.effective_batch}, micro-batch {s.micro_batch} "
                                  f"x {k} step{'s' if k != 1 else ''}"))
        if r.failed_request is not None:  # the run stopped where the card ran out
            rows.append(("peak", f"more than {format_bytes(_least_need(r))} "
                                 f"(baseline {format_bytes(b.peak)})"))
            rows.append(("out of memory", _out_of_memory(r)))
        else:
            rows.append(("peak", f"{format_bytes(r.peak)} (baseline {format_bytes(b.peak)})"))
            if r.reserved_peak is not None:
                rows.append(("reserved", f"{format_bytes(r.reserved_peak)} "
                                         f"(baseline {format_bytes(b.reserved_peak)})"))
            saving = b.need - r.need
            pct = saving / b.need if b.need else 0.0
            word = "saves" if saving >= 0 else "costs"
            what = "reserved" if r.reserved_peak is not None else "peak"
            rows.append((f"{what} vs baseline",
                         f"{word} {format_bytes(abs(saving))} ({abs(pct):.1%})"))
        if r.gpu_memory is not None:
            verdict = "fits" if r.fits else "does NOT fit"
            rows.append(("card", f"{r.gpu_name} {format_bytes(r.gpu_memory)}: {verdict}"))
        if r.peak_words:
            rows.append(("peak reached", r.peak_words))
        if r.interpolated:
            rows.append(("source", r.source))
        body = "".join(f"<tr><th style='text-align:left;padding-right:1em'>{html.escape(k)}</th>"
                       f"<td style='text-align:left'>{html.escape(v)}</td></tr>" for k, v in rows)
        return f"<table class='memmagic-whatif'>{body}</table>"

    # -- sweep --------------------------------------------------------------------------------------
    def run_sweep(self) -> "Sweep":
        """Run the batch size (the knob whose control says ``sweep``) across the slider's
        values for AMP x checkpointing (the sweep's axes, those that apply) on top of the
        current setting, and draw it under the panel."""
        from ..charts.plots import figure_png
        from ..whatif.sweeps import default_strategies, sweep

        swept = panel_sweep()
        ctl = self.controls.get(swept.name) if swept is not None else None
        if ctl is None:
            raise ValueError(f"this cell has no {swept.label if swept else 'knob'} to sweep")
        # each axis from its off end: the strategies add theirs
        axes = {k.name: k.default for k in KNOBS.values() if k.strategy is not None}
        base = self.current().replace(**axes)
        self.sweep_text.value = "<i>sweeping…</i>"
        try:
            result = sweep(self.cell, swept.name, list(ctl.options),
                           default_strategies(self.cell, self.knobs), setting=base)
        except Exception as exc:  # noqa: BLE001
            self.sweep_text.value = f"sweep failed: {html.escape(_short(f'{type(exc).__name__}: {exc}'))}"
            raise
        self.sweep_result = result
        self.sweep_image.value = figure_png(result.figure(), dpi=_PANEL_DPI)
        self.sweep_image.layout.display = ""
        self.sweep_text.value = html.escape(str(result))
        return result

    # -- fit map -------------------------------------------------------------------------------------
    def _plane_knobs(self) -> tuple[Any, Any] | None:
        """The batch and context controls, when the panel has both (a fit map's axes)."""
        from ..whatif.knobs import BATCH_DIM, SEQ_DIM, resizing

        b, s = (self.controls.get(resizing(d).name) for d in (BATCH_DIM, SEQ_DIM))
        return (b, s) if b is not None and s is not None else None

    def run_fit_map(self) -> "FitMap":
        """The fit map of the current setting over the batch and context sliders' ranges,
        drawn under the panel (where the sweep's chart goes)."""
        from ..charts.plots import figure_png
        from ..whatif.fitmap import fit_map

        axes = self._plane_knobs()
        if axes is None:
            raise ValueError("a fit map needs the batch size and the context length: this cell "
                             "has no control for one of them")
        (b_lo, *_, b_hi), (s_lo, *_, s_hi) = (list(c.options) for c in axes)
        self.sweep_text.value = "<i>drawing the fit map…</i>"
        try:
            step = 128 if s_hi >= 3 * 128 else max(1, s_hi // 4)  # at least 3 contexts
            result = fit_map(self.cell, setting=self.current(), batch=(b_lo, b_hi),
                             seq=(s_lo, s_hi), step=step)
        except Exception as exc:  # noqa: BLE001
            self.sweep_text.value = (f"fit map failed: "
                                     f"{html.escape(_short(f'{type(exc).__name__}: {exc}'))}")
            raise
        self.fit_map_result = result
        self.sweep_image.value = figure_png(result.figure(), dpi=_PANEL_DPI)
        self.sweep_image.layout.display = ""
        self.sweep_text.value = html.escape(f"{result} — {result.source}")
        return result

    # -- display -----------------------------------------------------------------------------------
    def __repr__(self) -> str:
        r = self.report
        how = " (evaluated)" if r.interpolated else ""
        text = f"<memmagic what-if: {self.setting.label()} -> peak {format_bytes(r.peak)}{how}"
        if self.setting != self.baseline:
            text += f" (baseline {format_bytes(self.baseline_report.peak)})"
        if r.fits is not None:
            text += f", {'fits' if r.fits else 'does NOT fit'} {r.gpu_name}"
        if r.failed_request is not None:
            text += f" (needs more than {format_bytes(_least_need(r))})"
        if self.error is not None:
            text += ", last re-run failed"
        return text + ">"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        data = self.box._repr_mimebundle_(**kwargs)
        if isinstance(data, tuple):  # (data, metadata)
            data = data[0]
        data = dict(data)
        data["text/plain"] = repr(self)
        # for a front end that shows no widgets: the chart and the numbers as they stand
        data["text/html"] = (f"<div class='memmagic-panel-static'>{self.chart.value}{self.text.value}"
                             "<div style='opacity:0.8'>(the what-if panel as it stood: its "
                             "controls need a running kernel and ipywidgets)</div></div>")
        return data


# The value a choice control holds for "as written" (ipywidgets reads None as "nothing
# selected": the control would show blank).
_UNSET = "(as written)"


def _shown(value: Any) -> Any:
    """A knob's value as its control holds it."""
    return _UNSET if value is None else value


def _wrap(label: str, width: int = 24) -> str:
    """A setting's label on lines of at most ``width`` characters, broken after commas (two
    bars' labels side by side must not run into each other)."""
    import textwrap

    return "\n".join(textwrap.wrap(label, width, break_long_words=False)) or label


def _least_need(report: MemoryReport) -> int:
    """The least a run that ran out of memory needs: what was live, and the request the
    card could not give (more follows: the run stopped there)."""
    return (report.live_at_failure or 0) + (report.failed_request or 0)


def _out_of_memory(report: MemoryReport) -> str:
    """Where a run ran out of memory, in one line."""
    return (f"needs more than {format_bytes(_least_need(report))}; it ran out asking for "
            f"{format_bytes(report.failed_request)} with {format_bytes(report.live_at_failure)} "
            "live (the chart shows what was held then)")


def _short(text: str, n: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _running_loop():
    import asyncio

    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
