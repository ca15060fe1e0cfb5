"""memmagic in a real browser: JupyterLab, Notebook 7 and Voila in headless Chromium.

The unit tests set widget values from Python; these tests do what a user does: open the
notebook in the front end, Run All, look at what rendered, drag the slider. They need
Debian's ``chromium`` and the pip packages ``playwright``, ``jupyterlab``, ``notebook`` and
``voila`` (``.ci/run`` installs them). Without them each test skips and says what is
missing, except under ``CI=true``, where a skip would hide that CI never looked at a
browser: there they fail.

Screenshots land in ``$MEMMAGIC_SCREENSHOTS`` (default ``tests/_screenshots``).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

import browser_support as bs


NOTEBOOKS = bs.REPO / "notebooks"
FIRST_STEPS = NOTEBOOKS / "01_first_steps.ipynb"
# the course's what-if tutorial (JupyterLab, Voila); a small fixture with a report, its
# chart and a panel (Notebook 7, VS Code's mime bundles)
PLAYGROUND = NOTEBOOKS / "15_whatif_playground.ipynb"
WHATIF = bs.REPO / "tests" / "browser" / "whatif_fixture.ipynb"
TALL = (1280, 1900)  # the whole what-if panel (controls, chart, table) in one screenshot

@pytest.fixture(scope="module")
def browser_ready() -> None:
    bs.require_browser()


@pytest.fixture(scope="module")
def lab(browser_ready):
    """One Jupyter server for the JupyterLab and Notebook 7 tests (it serves both), with the
    first tutorial and the what-if fixture in its root; each test shuts its kernel down."""
    with bs.jupyter_server("lab", {"01_first_steps.ipynb": FIRST_STEPS, "whatif.ipynb": WHATIF,
                                   "playground.ipynb": PLAYGROUND}) as server:
        yield server


@pytest.fixture
def page_on(lab):
    """``page_on(viewport)``: a fresh browser page (and its console) next to the ``lab``
    server; the test's kernels are shut down and the browser closed afterwards."""
    import contextlib

    with contextlib.ExitStack() as stack:
        stack.callback(lab.shutdown_kernels)
        stack.callback(lab.set_lab_setting, "@jupyterlab/apputils-extension:themes",
                       {"theme": bs.LIGHT_THEME})  # a test that went dark leaves it light
        yield lambda viewport=(1280, 900): stack.enter_context(bs.browser_page(viewport))


def stored_outputs(path: Path) -> dict[str, int]:
    """How many memmagic reports and PNG images the notebook's stored (nbval-checked)
    outputs hold: what a live run must render again."""
    nb = json.loads(path.read_text())
    reports = images = 0
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            html = "".join(data.get("text/html", ""))
            reports += "memmagic-report" in html
            images += "image/png" in data
    return {"reports": reports, "images": images}


_RENDERED_JS = """() => {
    const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)') || document;
    const imgs = [...panel.querySelectorAll('.jp-OutputArea-output img')].filter(i =>
        (i.src.startsWith('data:image/png') || i.src.startsWith('blob:')) && i.complete && i.naturalWidth > 0);
    const charts = [...panel.querySelectorAll('.jp-OutputArea-output svg.memmagic-chart')].filter(
        c => c.getBoundingClientRect().width > 0);
    return {reports: panel.querySelectorAll('.jp-OutputArea-output .memmagic-report').length,
            images: imgs.length, charts: charts.length};
}"""


def rendered_outputs(page, expected: dict[str, int], timeout_ms: int = 30_000) -> dict[str, int]:
    """Reports, decoded images (a figure's PNG, a widget's Image) and drawn panel charts
    (SVG) in the visible notebook's outputs, as counted for the keys of ``expected``, once
    they reach ``expected`` or after ``timeout_ms``."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    keys = sorted(expected)
    want = json.dumps({k: expected[k] for k in keys}, separators=(",", ":"))
    pick = "{" + ", ".join(f"{k}: r.{k}" for k in keys) + "}"
    try:
        page.wait_for_function(
            f"() => {{ const r = ({_RENDERED_JS})(); return JSON.stringify({pick}) === {json.dumps(want)}; }}",
            timeout=timeout_ms)
    except PlaywrightTimeout:
        pass  # the caller's assertion shows what rendered
    got = page.evaluate(_RENDERED_JS)
    return {k: got[k] for k in keys}


def report_rows(locator) -> dict[str, str]:
    """The header rows of a rendered report (``{"peak": "729.13 MiB (+260.06 MiB)", ...}``)."""
    return locator.evaluate("""el => Object.fromEntries([...el.querySelectorAll('tr')]
        .filter(tr => tr.querySelector('th') && tr.querySelector('td'))
        .map(tr => [tr.querySelector('th').textContent.trim(), tr.querySelector('td').textContent.trim()]))""")


def theme_colours(page, report: bool = True) -> dict[str, str]:
    """The computed background of the notebook and text colour of the first report."""
    return page.evaluate("""report => ({
        notebook: getComputedStyle(document.querySelector('.jp-Notebook')).backgroundColor,
        report: report ? getComputedStyle(document.querySelector('.memmagic-report')).color : null,
    })""", report)


def luminance(css_rgb: str) -> float:
    r, g, b = (int(v) for v in re.findall(r"\d+", css_rgb)[:3])
    return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255


def chart_contrast(page) -> float:
    """WCAG contrast of the panel chart's axis text against the notebook's background."""
    fill, background = page.evaluate("""() => [
        getComputedStyle(document.querySelector('svg.memmagic-chart text')).fill,
        getComputedStyle(document.querySelector('.jp-Notebook')).backgroundColor]""")

    def rel(css: str) -> float:
        channels = [int(v) / 255 for v in re.findall(r"\d+", css)[:3]]
        lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted((rel(fill), rel(background)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.parametrize("ci, outcome", [("", pytest.skip.Exception), ("true", pytest.fail.Exception)])
def test_without_a_browser_the_tests_skip_with_the_reason_and_fail_in_ci(monkeypatch, ci, outcome):
    monkeypatch.setattr(bs.shutil, "which", lambda name, *a, **k: None)
    with pytest.raises(outcome, match="`chromium` is not on PATH"):
        bs.require_browser({"CI": ci})


def test_parse_bytes_reads_the_sizes_the_panel_shows():
    assert bs.parse_bytes("114.34 MiB (baseline 68.08 MiB)") == round(114.34 * 2**20)
    assert bs.parse_bytes("0 B") == 0 and bs.parse_bytes("1,024.00 GiB") == 1024 * 2**30
    with pytest.raises(ValueError, match="no size"):
        bs.parse_bytes("fits")


def test_every_process_a_server_started_is_stopped(browser_ready):
    """A server and the kernel it started (in a session of its own) are gone after the
    server's context ends, also when the test inside it fails."""
    import psutil

    with pytest.raises(RuntimeError, match="inside"):
        with bs.jupyter_server("lab", {}) as server:
            kernel = server.api_post("/api/kernels", {"name": "python3"})
            bs.wait_for(lambda: len(bs._descendants(server.proc.pid)) >= 1, 60, "the kernel process")
            pids = [server.proc.pid] + [p.pid for p in bs._descendants(server.proc.pid)]
            assert kernel["id"]
            # the kernel is outside the server's process group: killing the group alone
            # would leave it running
            assert {os.getpgid(p) for p in pids[1:]} - {os.getpgid(server.proc.pid)}
            raise RuntimeError("a failure inside the server's context")
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []


# ---------------------------------------------------------------------------------------
# JupyterLab


@pytest.mark.slow
def test_first_steps_renders_in_jupyterlab_light_and_dark(lab, page_on):
    """The first tutorial, Run All in JupyterLab: every report and chart the stored
    notebook has renders again, in the light theme and after switching to the dark one,
    with no console error."""
    expected = stored_outputs(FIRST_STEPS)
    assert expected["reports"] >= 2 and expected["images"] >= 1, expected
    page, console = page_on()
    bs.open_notebook(page, lab, "01_first_steps.ipynb")
    assert console.mark() == []  # JupyterLab itself loads without an error
    bs.clear_and_run_all(page, lab, "01_first_steps.ipynb")
    report = page.locator(".jp-OutputArea-output .memmagic-report").first
    report.wait_for()
    assert rendered_outputs(page, expected) == expected
    rows = report_rows(report)
    assert re.match(r"[\d.]+ [KMG]?i?B", rows["peak"]), rows
    chart = page.locator(".jp-OutputArea-output img[src^='data:image/png']").first
    light = theme_colours(page)
    assert luminance(light["notebook"]) > 0.8 and luminance(light["report"]) < 0.4, light
    shots = [bs.save_screenshot(report, "lab_first_steps_report_light"),
             bs.save_screenshot(chart, "lab_first_steps_chart_light"),
             bs.save_screenshot(page, "lab_first_steps_window_light")]

    bs.set_lab_theme(page, bs.DARK_THEME)
    dark = theme_colours(page)
    # the report's text follows the theme: light text on the dark notebook
    assert luminance(dark["notebook"]) < 0.2 and luminance(dark["report"]) > 0.6, dark
    shots += [bs.save_screenshot(report, "lab_first_steps_report_dark"),
              bs.save_screenshot(chart, "lab_first_steps_chart_dark"),
              bs.save_screenshot(page, "lab_first_steps_window_dark")]
    assert console.errors_since_mark() == []
    assert all(p.stat().st_size > 1000 for p in shots)


# ---------------------------------------------------------------------------------------
# the what-if panel: JupyterLab, Voila, Notebook 7


def work_the_panel(page, prefix: str, *, only_slider: bool = False) -> list[Path]:
    """Drag the batch-size slider one step right (to twice the batch), turn AMP to fp16,
    checkpointing on and off again (``only_slider``: just the drag), as a user would; after
    each, the panel's numbers move the right way and its chart is redrawn. Returns the
    screenshots (before, and after each change)."""
    panel = bs.WhatIfPanelView(page)
    shots = [bs.save_screenshot(panel.box, f"{prefix}_0_baseline")]
    base = panel.state()
    # the chart is drawn: an SVG of real size with one visible segment per category held
    assert base.size[0] > 300 and base.size[1] > 150 and base.bar_heights, base
    assert all(h > 0 for h in base.bar_heights), base.bar_heights
    batch = int(re.search(r"batch (\d+)", base.rows["setting"]).group(1))

    assert panel.drag_slider("batch size", +1) == str(2 * batch)
    bigger = panel.wait_changed(base)
    assert f"batch {2 * batch}" in bigger.rows["setting"], bigger.rows
    assert bigger.peak > base.peak and bigger.svg != base.svg
    assert bigger.bar_heights != base.bar_heights and all(h > 0 for h in bigger.bar_heights)
    shots.append(bs.save_screenshot(panel.box, f"{prefix}_1_batch{2 * batch}"))
    if only_slider:
        return shots

    panel.click_toggle("AMP", "fp16")
    amp = panel.wait_changed(bigger)
    assert "amp fp16" in amp.rows["setting"], amp.rows
    assert amp.peak < bigger.peak and amp.svg != bigger.svg
    shots.append(bs.save_screenshot(panel.box, f"{prefix}_2_amp"))

    assert panel.click_checkbox("checkpointing") is True
    ckpt = panel.wait_changed(amp)
    assert "ckpt" in ckpt.rows["setting"], ckpt.rows
    assert ckpt.peak < amp.peak and ckpt.svg != amp.svg
    shots.append(bs.save_screenshot(panel.box, f"{prefix}_3_checkpointing"))

    assert panel.click_checkbox("checkpointing") is False
    back = panel.wait_changed(ckpt)
    assert back.rows["setting"] == amp.rows["setting"] and back.peak == amp.peak
    return shots


@pytest.mark.slow
def test_whatif_panel_in_jupyterlab(lab, page_on):
    page, console = page_on(TALL)
    bs.open_notebook(page, lab, "playground.ipynb")
    assert console.mark() == []
    bs.clear_and_run_all(page, lab, "playground.ipynb")
    # the panel's chart, in each of the panel's two views (under its cell, and where a
    # later cell shows it again)
    want = {"reports": 0, "charts": 2}
    assert rendered_outputs(page, want) == want
    shots = work_the_panel(page, "lab_whatif")
    shots.append(bs.save_screenshot(page, "lab_whatif_window"))
    assert chart_contrast(page) >= 3.0  # the chart's text on the light notebook
    bs.set_lab_theme(page, bs.DARK_THEME)
    assert luminance(theme_colours(page, report=False)["notebook"]) < 0.2
    panel = bs.WhatIfPanelView(page)
    dark = panel.state()
    assert dark.size[0] > 300 and all(h > 0 for h in dark.bar_heights), dark
    assert chart_contrast(page) >= 3.0  # and on the dark one
    shots += [bs.save_screenshot(panel.box, "lab_whatif_dark"),
              bs.save_screenshot(page, "lab_whatif_window_dark")]
    assert console.errors_since_mark() == []
    assert all(p.stat().st_size > 1000 for p in shots)


@pytest.mark.slow
def test_whatif_panel_in_voila(browser_ready):
    with bs.jupyter_server("voila", {"playground.ipynb": PLAYGROUND},
                           notebook="playground.ipynb") as server, \
            bs.browser_page(TALL) as (page, console):
        page.goto(server.url("/"))
        page.locator(".memmagic-whatif").first.wait_for(timeout=180_000)
        shots = work_the_panel(page, "voila_whatif")
        shots.append(bs.save_screenshot(page, "voila_whatif_window"))
        assert console.errors == []  # from loading the page (Voila runs the cells) on
    assert all(p.stat().st_size > 1000 for p in shots)


@pytest.mark.slow
def test_report_chart_and_panel_in_notebook7(lab, page_on):
    """Notebook 7's front end (``/notebooks/``, what ``jupyter notebook`` opens): Run All,
    the report, its chart and the panel render, and the panel answers its slider (the
    same widget manager as JupyterLab's; the full check is the JupyterLab test's)."""
    page, console = page_on(TALL)
    bs.open_notebook(page, lab, "whatif.ipynb", front_end="notebook7")
    # Notebook 7.6 logs an error of its own while it loads, before any cell runs (its
    # shortcuts plugin reads the schema of a plugin it did not load): not memmagic's
    at_load = console.mark()
    bs.clear_and_run_all(page, lab, "whatif.ipynb")
    want = {"reports": 1, "images": 1, "charts": 1}  # the report's chart (PNG), the panel's (SVG)
    assert rendered_outputs(page, want) == want
    report = page.locator(".jp-OutputArea-output .memmagic-report").first
    shots = [bs.save_screenshot(report, "nb7_report"), bs.save_screenshot(page, "nb7_window")]
    shots += work_the_panel(page, "nb7_whatif", only_slider=True)
    assert console.errors_since_mark() == [], at_load
    assert all(p.stat().st_size > 1000 for p in shots)


# ---------------------------------------------------------------------------------------
# VS Code: what its notebook renderers take (it cannot run here)
#
# VS Code's notebook view renders text/html and image/png itself (in a webview that sets
# --vscode-* CSS variables, not JupyterLab's --jp-* ones) and
# application/vnd.jupyter.widget-view+json through its ipywidgets renderer, which loads the
# ipywidgets 8 widget manager for models of @jupyter-widgets/controls 2.0.0 and needs the
# view's version_major 2. A saved notebook carries the widget state the same way.

_SCRIPTS = {"script", "iframe", "link", "style", "object", "embed"}
_VOID = {"br", "hr", "img", "input", "meta", "wbr", "col", "source", "area", "base"}


def html_problems(text: str) -> list[str]:
    """What would keep ``text`` (an output's HTML) from rendering the same, self-contained
    and following the theme, in VS Code's webview: scripts or external resources,
    unbalanced tags, JupyterLab colour variables without a fallback, text colours that do
    not follow VS Code's theme."""
    from html.parser import HTMLParser

    problems: list[str] = []
    stack: list[str] = []

    class Parser(HTMLParser):
        def handle_starttag(self, tag, attrs):
            if tag in _SCRIPTS:
                problems.append(f"<{tag}> element")
            for name, value in attrs:
                if name.startswith("on"):
                    problems.append(f"{name} handler on <{tag}>")
                if name in ("src", "href") and value and re.match(r"(https?:)?//", value):
                    problems.append(f"external {name}={value}")
            if tag not in _VOID:
                stack.append(tag)

        def handle_endtag(self, tag):
            if not stack or stack[-1] != tag:
                problems.append(f"</{tag}> closes <{stack[-1] if stack else 'nothing'}>")
            else:
                stack.pop()

    Parser().feed(text)
    problems += [f"unclosed <{t}>" for t in stack]
    problems += [f"{v} has no fallback" for v in re.findall(r"var\(--jp-[\w-]+\s*\)", text)]
    for colour in re.findall(r"(?<![-\w])color\s*:\s*([^;'\"]+)", text):
        if "--vscode-" not in colour:
            problems.append(f"text colour {colour.strip()!r} does not follow VS Code's theme")
    return problems


def test_html_problems_finds_what_vs_code_would_render_differently():
    ok = "<div style='color:var(--jp-ui-font-color2, var(--vscode-descriptionForeground, #555))'><b>x</b><br></div>"
    assert html_problems(ok) == []
    assert html_problems("<div><b>x</div>") == ["</div> closes <b>", "unclosed <div>", "unclosed <b>"]
    assert html_problems("<span style='color:var(--jp-ui-font-color1)'>x</span>") == [
        "var(--jp-ui-font-color1) has no fallback",
        "text colour 'var(--jp-ui-font-color1)' does not follow VS Code's theme"]
    assert html_problems("<img src='https://x.org/a.png'><script>1</script>") == [
        "external src=https://x.org/a.png", "<script> element"]


@pytest.mark.slow
def test_mime_bundles_are_what_vs_codes_renderers_take():
    """The fixture notebook run by a kernel (nbclient, widget state stored as VS Code and
    JupyterLab save it): the report is self-contained HTML that follows VS Code's theme,
    the chart a PNG, the panel an ipywidgets 8 view whose every model is in the state."""
    import base64

    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(WHATIF, as_version=4)
    NotebookClient(nb, timeout=180, kernel_name="python3", store_widget_state=True).execute()
    outputs = [o for cell in nb.cells for o in cell.get("outputs", [])]
    assert [o.output_type for o in outputs] == ["display_data"] * 3, outputs
    report, chart, panel = (o.data for o in outputs)

    assert "memmagic-report" in report["text/html"] and report["text/plain"].startswith("<MemoryReport")
    assert html_problems(report["text/html"]) == []
    assert base64.b64decode(chart["image/png"]).startswith(b"\x89PNG\r\n\x1a\n")
    assert chart["text/plain"].startswith("<memmagic chart")

    view = panel["application/vnd.jupyter.widget-view+json"]
    assert (view["version_major"], view["version_minor"]) == (2, 0), view
    assert panel["text/plain"].startswith("<memmagic what-if:")
    saved = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]
    assert saved["version_major"] == 2
    state = saved["state"]
    # every model the view reaches (children, layouts, styles) is saved, each an ipywidgets 8 one
    seen, todo = set(), [view["model_id"]]
    while todo:
        mid = todo.pop()
        if mid in seen:
            continue
        seen.add(mid)
        model = state[mid]
        assert (model["model_module"], model["model_module_version"]) in {
            ("@jupyter-widgets/controls", "2.0.0"), ("@jupyter-widgets/base", "2.0.0")}, model
        todo += re.findall(r"IPY_MODEL_(\w+)", json.dumps(model["state"]))
    models = {state[m]["model_name"] for m in seen}
    assert {"VBoxModel", "SelectionSliderModel", "ToggleButtonsModel", "CheckboxModel",
            "HTMLModel"} <= models, models
    # the panel's chart and its text travel as HTML values (SVG markup, a table)
    html_values = [state[m]["state"]["value"] for m in seen
                   if state[m]["model_name"] == "HTMLModel" and state[m]["state"].get("value")]
    assert any("memmagic-whatif" in v for v in html_values)
    assert any(v.startswith("<svg class='memmagic-chart'") for v in html_values)
    assert [p for v in html_values for p in html_problems(v)] == []
    # a front end without widgets shows the panel as it stood: the same chart and table
    assert "memmagic-chart" in panel["text/html"] and "memmagic-whatif" in panel["text/html"]
    assert html_problems(panel["text/html"]) == []
