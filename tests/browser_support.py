"""Harness for the real-browser tests: Jupyter servers on a free port, headless Chromium.

Nothing here is a test. ``tests/frontends/test_browser.py`` uses it to start a Jupyter server (which
serves JupyterLab at ``/lab`` and Notebook 7 at ``/notebooks``) or Voila on ``127.0.0.1`` (a free port, a token, a temporary root and temporary config,
settings, workspace, runtime and data directories, so nothing from the user's own Jupyter
setup leaks in and nothing is left behind), to drive Debian's ``chromium`` through
Playwright for Python (``executable_path``; ``playwright install`` is never needed), to
collect console errors and to save screenshots where a person can look at them after a
CI run (``$MEMMAGIC_SCREENSHOTS``, default ``tests/_screenshots``).

Every process a server starts (the server and the kernels it launches) is stopped when
its context ends, also after a failure: the kernels run in sessions of their own, so the
server's whole process tree is collected before it is signalled.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Flags Debian's chromium needs in a container without a display or a GPU (shared/NOTES.md).
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

# JupyterLab settings that keep the page still and the screenshots clean: no news or
# update notifications (they cover the bottom right corner), no recently-used restore.
LAB_SETTINGS: dict[str, dict[str, Any]] = {
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}

DARK_THEME = "JupyterLab Dark"
LIGHT_THEME = "JupyterLab Light"


def why_no_browser() -> str | None:
    """Why the browser tests cannot run here (``None`` when they can)."""
    missing = []
    if shutil.which("chromium") is None:
        missing.append("Debian's `chromium` is not on PATH (apt-get install chromium)")
    for module, pkg in (("playwright", "playwright"), ("jupyterlab", "jupyterlab"),
                        ("voila", "voila"), ("notebook", "notebook")):
        try:
            __import__(module)
        except ImportError:
            missing.append(f"`{pkg}` is not installed (pip install {pkg})")
    return "; ".join(missing) or None


def require_browser(environ: dict[str, str] | None = None) -> None:
    """Skip the calling test, saying what is missing, when the browser tests cannot run
    here; under ``CI=true`` fail instead, so that CI never passes without a browser."""
    import pytest

    why = why_no_browser()
    if why is None:
        return
    env = os.environ if environ is None else environ
    if env.get("CI", "").lower() == "true":
        pytest.fail(f"the browser tests cannot run in CI (CI=true): {why}", pytrace=False)
    pytest.skip(f"no browser to test in: {why}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def screenshot_dir() -> Path:
    """Where screenshots go: ``$MEMMAGIC_SCREENSHOTS`` or ``tests/_screenshots`` (created)."""
    path = Path(os.environ.get("MEMMAGIC_SCREENSHOTS") or REPO / "tests" / "_screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------------------
# servers


@dataclass
class Server:
    """A running Jupyter server (``lab``) or Voila server (``voila``) on 127.0.0.1."""

    kind: str
    port: int
    token: str
    root: Path
    home: Path
    proc: subprocess.Popen
    log_path: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        """``path`` on this server with the token (``path`` starts with ``/``)."""
        sep = "&" if "?" in path else "?"
        return f"{self.base}{path}{sep}token={self.token}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def api(self, path: str) -> Any:
        """GET ``/api/...`` as JSON (jupyter servers only)."""
        with urllib.request.urlopen(self.url(path), timeout=10) as r:
            return json.load(r)

    def shutdown_kernels(self) -> None:
        """Shut down every kernel this server runs (a test's notebook leaves one behind)."""
        for kernel in self.api("/api/kernels"):
            self.api_request("DELETE", f"/api/kernels/{kernel['id']}")

    def set_lab_setting(self, plugin: str, values: dict[str, Any]) -> None:
        """Store JupyterLab's user settings of ``plugin`` (``"@jupyterlab/apputils-extension:themes"``)."""
        self.api_request("PUT", f"/lab/api/settings/{plugin}", {"raw": json.dumps(values)})

    def api_request(self, method: str, path: str, body: dict | None = None) -> Any:
        """``method`` ``/api/...`` with ``body`` as JSON; the answer as JSON (None if empty)."""
        req = urllib.request.Request(
            self.base + path, method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            data = r.read()
        return json.loads(data) if data else None

    def api_post(self, path: str, body: dict) -> Any:
        """POST ``body`` as JSON to ``/api/...``; the answer as JSON."""
        return self.api_request("POST", path, body)


def _env(home: Path) -> dict[str, str]:
    """The server's environment: the test's Python first on PATH, every Jupyter/IPython
    directory a user could have configured pointed into ``home``."""
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)  # the kernel uses the inline backend, as in a user's notebook
    env.update({
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_DATA_DIR": str(home / "data"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
        "JUPYTER_PREFER_ENV_PATH": "1",
        "IPYTHONDIR": str(home / "ipython"),
        "PYTHONUNBUFFERED": "1",
    })
    return env


def write_lab_settings(home: Path, theme: str = LIGHT_THEME) -> None:
    """JupyterLab's user settings in ``home/settings``: ``LAB_SETTINGS`` and ``theme``."""
    settings = dict(LAB_SETTINGS)
    settings["@jupyterlab/apputils-extension/themes"] = {"theme": theme}
    for key, value in settings.items():
        path = home / "settings" / f"{key}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


def _command(kind: str, port: int, token: str, root: Path, notebook: str | None) -> list[str]:
    if kind == "lab":
        cmd = [str(BIN / "jupyter"), "lab", "--no-browser", f"--port={port}",
               "--ServerApp.ip=127.0.0.1", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
               # no update check, no news feed (the settings turn their pop-ups off)
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--LabApp.news_url=None"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")  # CI runs as root in a container
        return cmd
    if kind == "voila":
        cmd = [str(BIN / "voila"), "--no-browser", f"--port={port}", "--Voila.ip=127.0.0.1",
               "--Voila.port_retries=0", f"--Voila.token={token}", f"--Voila.root_dir={root}",
               "--VoilaConfiguration.show_tracebacks=True",
               # Notebook 7's and jupytext's JupyterLab extensions fail to load in Voila
               # (they want the document manager Voila does not have) and log an error on
               # every page; a dashboard has no use for either
               "--VoilaConfiguration.extension_denylist="
               "['@jupyter-notebook/lab-extension', 'jupyterlab-jupytext']"]
        return cmd + ([str(root / notebook)] if notebook else [])
    raise ValueError(f"server kind must be 'lab' or 'voila', not {kind!r}")


def _descendants(pid: int) -> list[Any]:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def stop_process_tree(proc: subprocess.Popen, timeout: float = 10.0) -> list[int]:
    """Stop ``proc`` (started with ``start_new_session``), its process group and every
    descendant (kernels run in sessions of their own). Returns the pids that were alive
    at the start; they are all gone when this returns, or it raises ``RuntimeError``."""
    import psutil

    tree = _descendants(proc.pid)
    pids = [proc.pid] + [p.pid for p in tree]
    # kernels first (the server would wait seconds on each one's shutdown reply), then the
    # server's process group; whatever is left after a grace period is killed
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(tree, timeout=3)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)
    _, alive = psutil.wait_procs(tree, timeout=timeout)
    if alive:
        raise RuntimeError(f"processes still alive after stopping the server: {alive}")
    return pids


@contextlib.contextmanager
def jupyter_server(kind: str, files: dict[str, Path], *, theme: str = LIGHT_THEME,
                   notebook: str | None = None, timeout: float = 90.0) -> Iterator[Server]:
    """Start ``jupyter lab`` (``kind="lab"``; it serves Notebook 7's pages too when the
    ``notebook`` package is installed) or ``voila`` serving a temporary root
    with ``files`` (name in the root -> source path) copied in; stop it and every process
    it started on exit. For voila, ``notebook`` names the one notebook it serves."""
    with tempfile.TemporaryDirectory(prefix=f"memmagic-{kind}-") as tmp:
        home = Path(tmp)
        root = home / "root"
        root.mkdir()
        for name, src in files.items():
            shutil.copy(src, root / name)
        write_lab_settings(home, theme)
        port = free_port()
        token = secrets.token_hex(16)
        log_path = home / "server.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                _command(kind, port, token, root, notebook), cwd=root, env=_env(home),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        server = Server(kind, port, token, root, home, proc, log_path)
        try:
            _wait_until_up(server, timeout)
            yield server
        finally:
            stop_process_tree(proc)


def _wait_until_up(server: Server, timeout: float) -> None:
    path = "/api/status" if server.kind != "voila" else "/"
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.kind} exited with {server.proc.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(server.url(path), timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.kind} did not answer in {timeout:.0f} s:\n{server.log()}")
            time.sleep(0.2)


# ---------------------------------------------------------------------------------------
# the browser


@dataclass
class Console:
    """Console errors and uncaught page errors seen by a page, and the requests it made to
    hosts other than 127.0.0.1 (answered empty: the tests never use the network)."""

    errors: list[str] = field(default_factory=list)
    all: list[str] = field(default_factory=list)
    external: list[str] = field(default_factory=list)
    _mark: int = 0

    def mark(self) -> list[str]:
        """Start counting errors from here (e.g. once the front end has loaded, before any
        cell runs); returns the errors logged before."""
        self._mark = len(self.errors)
        return self.errors[: self._mark]

    def errors_since_mark(self) -> list[str]:
        return self.errors[self._mark:]

    def on_console(self, msg: Any) -> None:
        loc = msg.location or {}
        line = f"[{msg.type}] {msg.text} ({loc.get('url', '')}:{loc.get('lineNumber', '')})"
        self.all.append(line)
        if msg.type == "error":
            self.errors.append(line)

    def on_page_error(self, exc: Any) -> None:
        stack = (getattr(exc, "stack", None) or "").strip().splitlines()
        where = f" ({stack[1].strip()})" if len(stack) > 1 else ""
        line = f"[pageerror] {exc}{where}"
        self.all.append(line)
        self.errors.append(line)


# any URL whose host is not 127.0.0.1 (Voila's template links a CDN's font CSS)
_NOT_LOCAL = re.compile(r"^(?!(https?|wss?)://127\.0\.0\.1[:/])(?!data:|blob:)[a-z]+:")


@contextlib.contextmanager
def browser_page(viewport: tuple[int, int] = (1280, 900)) -> Iterator[tuple[Any, Console]]:
    """A page in headless Chromium with a fresh profile; yields ``(page, console)``."""
    from playwright.sync_api import sync_playwright

    executable = shutil.which("chromium")
    if executable is None:
        raise RuntimeError("chromium is not on PATH")
    with tempfile.TemporaryDirectory(prefix="memmagic-chromium-") as profile, \
            sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=executable, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": viewport[0], "height": viewport[1]}, device_scale_factor=1)
        try:
            context.set_default_timeout(60_000)
            page = context.pages[0] if context.pages else context.new_page()
            console = Console()
            page.on("console", console.on_console)
            page.on("pageerror", console.on_page_error)

            def offline(route: Any) -> None:
                console.external.append(route.request.url)
                route.fulfill(status=200, body="")

            context.route(_NOT_LOCAL, offline)
            yield page, console
        finally:
            context.close()


def save_screenshot(target: Any, name: str) -> Path:
    """Screenshot ``target`` (a page or a locator) to ``screenshot_dir()/name.png``."""
    path = screenshot_dir() / f"{name}.png"
    target.screenshot(path=str(path))
    return path


# ---------------------------------------------------------------------------------------
# JupyterLab / Notebook 7 pages


def kernel_state(server: Server, name: str) -> str | None:
    """The execution state the server holds for the kernel of notebook ``name``
    (``idle``, ``busy``, ``starting``; ``None`` while it has no session)."""
    for session in server.api("/api/sessions"):
        if Path(session.get("path", "")).name == name and session.get("kernel"):
            return session["kernel"].get("execution_state")
    return None


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    """Poll ``predicate()`` every 0.2 s until it is true; ``TimeoutError`` naming ``what``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


# where each front end opens a notebook; ``{}`` is the notebook's path. JupyterLab's
# ``?reset`` starts from an empty workspace (no tabs a previous test left open)
FRONT_ENDS = {"lab": "/lab/tree/{}?reset", "notebook7": "/notebooks/{}"}


def open_notebook(page: Any, server: Server, name: str, front_end: str = "lab",
                  timeout: float = 120.0) -> None:
    """Open ``name`` (in the server's root) in JupyterLab (``front_end="lab"``) or
    Notebook 7 (``"notebook7"``) and wait until all its cells are on the page and its
    kernel is idle."""
    if front_end not in FRONT_ENDS:
        raise ValueError(f"front_end must be one of {', '.join(FRONT_ENDS)}, not {front_end!r}")
    page.goto(server.url(FRONT_ENDS[front_end].format(name)))
    cells = len(json.loads((server.root / name).read_text())["cells"])
    page.wait_for_function(
        f"() => document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell').length >= {cells}",
        timeout=timeout * 1000)
    wait_for(lambda: kernel_state(server, name) == "idle", timeout, f"the kernel of {name}")


def menu(page: Any, *path: str) -> None:
    """Click through the menu bar: ``menu(page, "Run", "Run All Cells")``."""
    page.locator(".lm-MenuBar-itemLabel", has_text=_exactly(path[0])).first.click()
    for item in path[1:]:
        page.locator(".lm-Menu:visible .lm-Menu-itemLabel", has_text=_exactly(item)).first.click()


def _exactly(text: str) -> re.Pattern:
    return re.compile(rf"^\s*{re.escape(text)}\s*$")


_PROMPTS_JS = "() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt')].map(p => p.textContent.trim())"


def clear_and_run_all(page: Any, server: Server, name: str, timeout: float = 150.0) -> None:
    """Edit > Clear Outputs of All Cells, then Run > Run All Cells, then wait until every
    code cell shows an execution count and the kernel is idle."""
    menu(page, "Edit", "Clear Outputs of All Cells")
    page.wait_for_function(
        f"() => ({_PROMPTS_JS})().every(p => !/\\d/.test(p))", timeout=timeout * 1000)
    menu(page, "Run", "Run All Cells")
    page.wait_for_function(
        f"() => {{ const ps = ({_PROMPTS_JS})(); return ps.length > 0 && ps.every(p => /\\[\\d+\\]/.test(p)); }}",
        timeout=timeout * 1000)
    wait_for(lambda: kernel_state(server, name) == "idle", timeout, f"the kernel of {name}")


def set_lab_theme(page: Any, theme: str) -> None:
    """Settings > Theme > ``theme``, then wait until the whole page wears it: the menu bar,
    the status bar and the notebook all dark (or all light); the notebook's colours change
    before the rest of the window's do."""
    dark = "Light" not in theme
    menu(page, "Settings", "Theme", theme)
    page.wait_for_function("""([name, dark]) => {
        if (document.body.dataset.jpThemeName !== name) return false;
        return ['#jp-top-panel', '#jp-main-statusbar', '.jp-Notebook'].every(sel => {
            const el = document.querySelector(sel);
            if (!el) return true;
            const [r, g, b] = getComputedStyle(el).backgroundColor.match(/\\d+/g).map(Number);
            return (r + g + b < 3 * 110) === dark;
        });
    }""", arg=[theme, dark])


# ---------------------------------------------------------------------------------------
# the what-if panel, as a user works it

_SIZE = re.compile(r"([\d.,]+)\s*(B|KiB|MiB|GiB|TiB)\b")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_bytes(text: str) -> int:
    """The first size in ``text`` (``"114.34 MiB (baseline 68.08 MiB)"`` -> 119894671)."""
    m = _SIZE.search(text)
    if m is None:
        raise ValueError(f"no size in {text!r}")
    return round(float(m.group(1).replace(",", "")) * _UNITS[m.group(2)])


@dataclass(frozen=True)
class PanelState:
    """What the what-if panel shows: its table's rows, its chart's markup (an SVG element in
    the page), the chart's size as drawn and the heights of its bar segments as drawn."""

    rows: dict[str, str]
    svg: str
    size: tuple[float, float]
    bar_heights: tuple[float, ...]

    @property
    def peak(self) -> int:
        return parse_bytes(self.rows["peak"])


class WhatIfPanelView:
    """The what-if panel on a page (JupyterLab, Notebook 7 or Voila), found by its table
    (``.memmagic-whatif``), worked through its widgets as a user works them."""

    def __init__(self, page: Any) -> None:
        self.page = page
        table = page.locator(".memmagic-whatif")
        table.first.wait_for()
        # the panel's outermost widget box: the vbox that holds the controls and the table
        self.box = page.locator(".widget-vbox").filter(has=table).filter(
            has=page.locator(".widget-hslider")).last
        self.box.wait_for()

    def _control(self, css: str, label: str) -> Any:
        """The control ``css`` in the panel's row named ``label`` (the row's name column)."""
        row = self.box.locator(".memmagic-row").filter(
            has=self.page.locator(".memmagic-knob", has_text=_exactly(label)))
        return row.locator(css)

    def state(self) -> PanelState:
        """The rows and the chart as the browser holds and draws them."""
        data = self.box.evaluate("""box => {
            const rows = Object.fromEntries([...box.querySelectorAll('.memmagic-whatif tr')]
                .map(tr => [tr.querySelector('th').textContent.trim(), tr.querySelector('td').textContent.trim()]));
            const svg = box.querySelector('svg.memmagic-chart');
            const r = svg.getBoundingClientRect();
            const bars = [...svg.querySelectorAll('rect')].filter(e => e.querySelector('title'))
                .map(e => e.getBoundingClientRect().height);
            return {rows, svg: svg.outerHTML, size: [r.width, r.height], bars};
        }""")
        return PanelState(data["rows"], data["svg"], tuple(data["size"]), tuple(data["bars"]))

    def wait_changed(self, before: PanelState, timeout_ms: int = 60_000) -> PanelState:
        """Wait until the kernel redrew the panel after a change (its table and its chart
        both replaced) and nothing is re-running; the new state."""
        self.box.evaluate("""(box, [rows, svg, timeout]) => new Promise((resolve, reject) => {
            const t0 = Date.now();
            const tick = () => {
                const text = [...box.querySelectorAll('.memmagic-whatif tr')].map(tr => tr.textContent).join('|');
                const chart = box.querySelector('svg.memmagic-chart');
                const busy = box.textContent.includes('re-running');
                if (text !== rows && chart && chart.outerHTML !== svg && !busy) return resolve();
                if (Date.now() - t0 > timeout) return reject(new Error('the panel did not redraw: ' + text));
                setTimeout(tick, 100);
            };
            tick();
        })""", ["|".join(f"{k}{v}" for k, v in before.rows.items()), before.svg, timeout_ms])
        return self.state()

    def drag_slider(self, label: str, steps: int) -> str:
        """Drag the handle of slider ``label`` by ``steps`` of its steps (right when
        positive) with the mouse; returns the readout after the drop."""
        slider = self._control(".widget-hslider", label)
        handle = slider.locator(".noUi-handle")
        handle.scroll_into_view_if_needed()
        track = slider.locator(".noUi-base").bounding_box()
        lo = float(handle.get_attribute("aria-valuemin"))
        hi = float(handle.get_attribute("aria-valuemax"))
        now = float(handle.get_attribute("aria-valuenow"))
        box = handle.bounding_box()
        x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        dx = track["width"] * steps / (hi - lo)
        self.page.mouse.move(x, y)
        self.page.mouse.down()
        self.page.mouse.move(x + dx / 2, y, steps=5)
        self.page.mouse.move(x + dx, y, steps=5)
        self.page.mouse.up()
        self.page.wait_for_function(
            "([h, v]) => Number(h.getAttribute('aria-valuenow')) === v",
            arg=[handle.element_handle(), now + steps])
        return slider.locator(".widget-readout").inner_text().strip()

    def click_toggle(self, label: str, option: str) -> None:
        """Click button ``option`` of toggle buttons ``label``; waits until it is active."""
        button = self._control(".widget-toggle-buttons", label).locator(
            ".widget-toggle-button", has_text=_exactly(option))
        button.click()
        self.page.wait_for_function("b => b.classList.contains('mod-active')",
                                    arg=button.element_handle())

    def click_checkbox(self, label: str) -> bool:
        """Click checkbox ``label``; returns whether it is checked now."""
        box = self._control(".widget-checkbox", label).locator("input[type=checkbox]")
        was = box.is_checked()
        box.click()
        self.page.wait_for_function("([b, v]) => b.checked === v", arg=[box.element_handle(), not was])
        return not was
