"""A real Jupyter kernel for tests that need one (real SIGINTs, fresh imports): cells are
sent as a front end sends them and their replies read from the kernel's channels."""

from __future__ import annotations

import os
from dataclasses import dataclass

from jupyter_client.manager import start_new_kernel


@dataclass
class Reply:
    """What one cell gave: its error's name (None when it ran), stdout and stderr (with
    the error's traceback)."""

    error: str | None
    out: str
    err: str


class Kernel:
    """A fresh kernel of this Python (its own process), shut down by :meth:`close`."""

    def __init__(self, cwd: str | None = None) -> None:
        env = {**os.environ, "MPLBACKEND": "Agg"}
        self.km, self.kc = start_new_kernel(kernel_name="python3", cwd=cwd, env=env)

    def send(self, code: str) -> str:
        return self.kc.execute(code)

    def printed(self, msg_id: str, text: str, timeout: float = 60) -> None:
        """Wait until the cell ``msg_id`` prints ``text`` (it runs the user's code: a
        SIGINT sent before that can land in the kernel's own code, not the cell's)."""
        while True:
            msg = self.kc.get_iopub_msg(timeout=timeout)
            if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream"
                    and text in msg["content"]["text"]):
                return

    def reply(self, msg_id: str, timeout: float = 120) -> Reply:
        """Wait for the cell ``msg_id`` to end (queue.Empty after ``timeout`` s of silence)."""
        out: list[str] = []
        err: list[str] = []
        error = None
        while True:
            msg = self.kc.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                (out if content["name"] == "stdout" else err).append(content["text"])
            elif kind == "error":
                error = content["ename"]
                err.append("\n".join(content["traceback"]))
            elif kind == "status" and content["execution_state"] == "idle":
                break
        while self.kc.get_shell_msg(timeout=timeout)["parent_header"].get("msg_id") != msg_id:
            pass
        return Reply(error, "".join(out), "".join(err))

    def run(self, code: str, timeout: float = 120) -> Reply:
        return self.reply(self.send(code), timeout)

    def interrupt(self) -> None:
        self.km.interrupt_kernel()

    def alive(self) -> bool:
        return self.km.is_alive()

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)

