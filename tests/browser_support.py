"""Harness for the real-browser tests: Jupyter servers on a free port, headless Chromium.

Nothing here is a test. ``tests/test_browser.py`` uses it to start JupyterLab, Notebook 7
or Voila on ``127.0.0.1`` (a free port, a token, a temporary root and temporary config,
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
    """A running Jupyter server (lab, notebook or voila) on 127.0.0.1."""

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

    def api_post(self, path: str, body: dict) -> Any:
        """POST ``body`` as JSON to ``/api/...``; the answer as JSON."""
        req = urllib.request.Request(
            self.base + path, data=json.dumps(body).encode(), method="POST",
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r)


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
    common = ["--no-browser", f"--port={port}"]
    if kind in ("lab", "notebook"):
        cmd = [str(BIN / "jupyter"), kind, *common,
               "--ServerApp.ip=127.0.0.1", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
               ]
        if kind == "lab":  # no update check, no news feed (the settings turn their pop-ups off)
            cmd += ["--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                    "--LabApp.news_url=None"]
    elif kind == "voila":
        cmd = [str(BIN / "voila"), *common, "--Voila.ip=127.0.0.1", "--Voila.port_retries=0",
               f"--Voila.token={token}", f"--Voila.root_dir={root}",
               "--VoilaConfiguration.show_tracebacks=True"]
        if notebook:
            cmd.append(str(root / notebook))
    else:
        raise ValueError(f"server kind must be 'lab', 'notebook' or 'voila', not {kind!r}")
    if hasattr(os, "geteuid") and os.geteuid() == 0 and kind != "voila":
        cmd.append("--allow-root")  # CI runs as root in a container
    return cmd


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

    tree = [p for p in _descendants(proc.pid)]
    pids = [proc.pid] + [p.pid for p in tree]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)  # the server shuts its kernels down on SIGTERM
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    _, alive = psutil.wait_procs(tree, timeout=timeout)
    if alive:
        raise RuntimeError(f"processes still alive after stopping the server: {alive}")
    return pids


@contextlib.contextmanager
def jupyter_server(kind: str, files: dict[str, Path], *, theme: str = LIGHT_THEME,
                   notebook: str | None = None, timeout: float = 90.0) -> Iterator[Server]:
    """Start ``jupyter lab`` / ``jupyter notebook`` / ``voila`` serving a temporary root
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
    """Console errors and uncaught page errors seen by a page."""

    errors: list[str] = field(default_factory=list)
    all: list[str] = field(default_factory=list)

    def on_console(self, msg: Any) -> None:
        loc = msg.location or {}
        line = f"[{msg.type}] {msg.text} ({loc.get('url', '')}:{loc.get('lineNumber', '')})"
        self.all.append(line)
        if msg.type == "error":
            self.errors.append(line)

    def on_page_error(self, exc: Any) -> None:
        line = f"[pageerror] {exc}"
        self.all.append(line)
        self.errors.append(line)


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


def open_notebook(page: Any, server: Server, name: str, timeout: float = 120.0) -> None:
    """Open ``name`` (in the server's root) in JupyterLab or Notebook 7 and wait until all
    its cells are on the page and its kernel is idle."""
    page.goto(server.url(f"/lab/tree/{name}" if server.kind == "lab" else f"/notebooks/{name}"))
    cells = len(json.loads((server.root / name).read_text())["cells"])
    page.wait_for_function(
        f"() => document.querySelectorAll('.jp-NotebookPanel .jp-Notebook > .jp-WindowedPanel-outer .jp-Cell, "
        f".jp-NotebookPanel .jp-Notebook .jp-Cell').length >= {cells}", timeout=timeout * 1000)
    wait_for(lambda: kernel_state(server, name) == "idle", timeout, f"the kernel of {name}")


def menu(page: Any, *path: str) -> None:
    """Click through the menu bar: ``menu(page, "Run", "Run All Cells")``."""
    page.locator(".lm-MenuBar-itemLabel", has_text=_exactly(path[0])).first.click()
    for item in path[1:]:
        page.locator(".lm-Menu:visible .lm-Menu-itemLabel", has_text=_exactly(item)).first.click()


def _exactly(text: str) -> re.Pattern:
    return re.compile(rf"^\s*{re.escape(text)}\s*$")


_PROMPTS_JS = "() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt')].map(p => p.textContent.trim())"


def prompts(page: Any) -> list[str]:
    """The input prompts of the visible notebook's code cells (``[3]:``, ``[*]:``, ``[ ]:``)."""
    return page.evaluate(_PROMPTS_JS)


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
    """Settings > Theme > ``theme``, then wait until the page wears it."""
    light = "true" if "Light" in theme else "false"
    menu(page, "Settings", "Theme", theme)
    page.wait_for_function(
        f"() => document.body.dataset.jpThemeLight === '{light}' && "
        f"document.body.dataset.jpThemeName === {json.dumps(theme)}")
