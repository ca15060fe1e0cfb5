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

# Console messages that are not errors of memmagic or the widgets, each with the reason it
# is allowed. Everything else logged at level "error" (and every uncaught page error) fails.
ALLOWED_CONSOLE_ERRORS: list[tuple[re.Pattern, str]] = []


@pytest.fixture(scope="module")
def browser_ready() -> None:
    bs.require_browser()


def console_errors(console: bs.Console) -> list[str]:
    return [e for e in console.errors if not any(p.search(e) for p, _ in ALLOWED_CONSOLE_ERRORS)]


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


def rendered_outputs(page) -> dict[str, int]:
    """Reports and decoded PNG images in the visible notebook's outputs."""
    return page.evaluate("""() => {
        const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)') || document;
        const imgs = [...panel.querySelectorAll('.jp-OutputArea-output img')]
            .filter(i => i.src.startsWith('data:image/png') && i.complete && i.naturalWidth > 0);
        return {reports: panel.querySelectorAll('.jp-OutputArea-output .memmagic-report').length,
                images: imgs.length};
    }""")


def report_rows(locator) -> dict[str, str]:
    """The header rows of a rendered report (``{"peak": "729.13 MiB (+260.06 MiB)", ...}``)."""
    return locator.evaluate("""el => Object.fromEntries([...el.querySelectorAll('tr')]
        .filter(tr => tr.querySelector('th') && tr.querySelector('td'))
        .map(tr => [tr.querySelector('th').textContent.trim(), tr.querySelector('td').textContent.trim()]))""")


def theme_colours(page) -> dict[str, str]:
    """The computed background of the notebook and text colour of the first report."""
    return page.evaluate("""() => ({
        notebook: getComputedStyle(document.querySelector('.jp-Notebook')).backgroundColor,
        report: getComputedStyle(document.querySelector('.memmagic-report')).color,
    })""")


def luminance(css_rgb: str) -> float:
    r, g, b = (int(v) for v in re.findall(r"\d+", css_rgb)[:3])
    return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255


@pytest.mark.parametrize("ci, outcome", [("", pytest.skip.Exception), ("true", pytest.fail.Exception)])
def test_without_a_browser_the_tests_skip_with_the_reason_and_fail_in_ci(monkeypatch, ci, outcome):
    monkeypatch.setattr(bs.shutil, "which", lambda name, *a, **k: None)
    with pytest.raises(outcome, match="`chromium` is not on PATH"):
        bs.require_browser({"CI": ci})


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
def test_first_steps_renders_in_jupyterlab_light_and_dark(browser_ready):
    """The first tutorial, Run All in JupyterLab: every report and chart the stored
    notebook has renders again, in the light theme and after switching to the dark one,
    with no console error."""
    expected = stored_outputs(FIRST_STEPS)
    assert expected["reports"] >= 2 and expected["images"] >= 1, expected
    with bs.jupyter_server("lab", {"01_first_steps.ipynb": FIRST_STEPS}) as server, \
            bs.browser_page() as (page, console):
        bs.open_notebook(page, server, "01_first_steps.ipynb")
        bs.clear_and_run_all(page, server, "01_first_steps.ipynb")
        report = page.locator(".jp-OutputArea-output .memmagic-report").first
        report.wait_for()
        assert rendered_outputs(page) == expected
        rows = report_rows(report)
        assert re.match(r"[\d.]+ [KMG]?i?B", rows["peak"]), rows
        chart = page.locator(".jp-OutputArea-output img[src^='data:image/png']").first
        light = theme_colours(page)
        assert luminance(light["notebook"]) > 0.8 and luminance(light["report"]) < 0.4, light
        shots = [bs.save_screenshot(report, "lab_first_steps_report_light"),
                 bs.save_screenshot(chart, "lab_first_steps_chart_light"),
                 bs.save_screenshot(page, "lab_first_steps_window_light")]

        bs.set_lab_theme(page, bs.DARK_THEME)
        page.wait_for_function("""() => {
            const c = getComputedStyle(document.querySelector('.jp-Notebook')).backgroundColor;
            const [r, g, b] = c.match(/\\d+/g).map(Number); return r + g + b < 150; }""")
        dark = theme_colours(page)
        # the report's text follows the theme: light text on the dark notebook
        assert luminance(dark["notebook"]) < 0.2 and luminance(dark["report"]) > 0.6, dark
        shots += [bs.save_screenshot(report, "lab_first_steps_report_dark"),
                  bs.save_screenshot(chart, "lab_first_steps_chart_dark"),
                  bs.save_screenshot(page, "lab_first_steps_window_dark")]
        assert console_errors(console) == [], console.errors
    assert all(p.stat().st_size > 1000 for p in shots)
