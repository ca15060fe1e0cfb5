"""``%gpusim``: run every cell of a notebook on the simulated GPU.

``%gpusim on [--gpu T4] [--gpu-memory 10GiB]`` makes each following cell run as a
``%%gpumem --backend sim`` cell against the notebook's one simulated GPU (see
:mod:`memmagic.backends.sim.session`), with a one-line memory footer instead of the
full report; ``%%gpumem`` cells in that mode give the full report against the same GPU.
``%gpusim off`` goes back to real cells; ``%gpusim reset`` empties the simulated GPU;
``%gpusim`` alone says where things stand.

The mode works by an input transformer (IPython's ``input_transformers_cleanup``) that
puts ``%%gpumem --backend sim --footer`` in front of each cell; cells made only of
magics, shell escapes and comments, and cells that start with a cell magic, are left
alone.
"""

from __future__ import annotations

import contextlib
import shlex
from typing import Any, Iterator

__all__ = ["SimMode", "sim_mode", "suspended"]

_USAGE = ("usage: %gpusim on [--gpu NAME] [--gpu-memory SIZE] | %gpusim off | %gpusim reset | "
          "%gpusim")


class SimMode:
    """The notebook-wide switch of one shell."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.on = False
        self.gpu: str | None = None
        self.gpu_memory: str | None = None
        self._busy = 0

    # -- the input transformer ---------------------------------------------------------
    def transform(self, lines: list[str]) -> list[str]:
        if not self.on or self._busy:
            return lines
        code = [ln for ln in lines if ln.strip()]
        if not code or code[0].lstrip().startswith("%%"):
            return lines
        if all(ln.lstrip().startswith(("%", "!", "#")) for ln in code):
            return lines
        return [self.magic_line() + "\n", *lines]

    def magic_line(self) -> str:
        opts = ""
        if self.gpu:
            opts += f" --gpu {shlex.quote(self.gpu)}"
        if self.gpu_memory:
            opts += f" --gpu-memory {shlex.quote(self.gpu_memory)}"
        return f"%%gpumem --backend sim --footer{opts}"

    def install(self) -> None:
        cleanup = self.shell.input_transformers_cleanup
        if self.transform not in cleanup:
            cleanup.append(self.transform)

    def uninstall(self) -> None:
        cleanup = self.shell.input_transformers_cleanup
        while self.transform in cleanup:
            cleanup.remove(self.transform)

    # -- the line magic ------------------------------------------------------------------
    def command(self, line: str) -> str:
        """Carry out ``%gpusim LINE``; the line to show."""
        from IPython.core.error import UsageError

        from .backends.sim.gpus import resolve_target
        from .backends.sim.session import shell_session

        try:
            words = shlex.split(line)
        except ValueError as exc:
            raise UsageError(f"%gpusim: {exc}; {_USAGE}") from None
        if not words or words == ["status"]:
            state = "on" if self.on else "off"
            return f"%gpusim is {state}; " + shell_session(self.shell).status()
        verb, rest = words[0], words[1:]
        if verb == "off" and not rest:
            self.on = False
            return "%gpusim off: cells run for real again (the simulated GPU keeps its tensors)"
        if verb == "reset" and not rest:
            held = shell_session(self.shell).reset()
            from .report import format_bytes

            return f"the simulated GPU was emptied ({format_bytes(held)} freed)"
        if verb != "on":
            raise UsageError(f"%gpusim: unknown {' '.join(words)!r}; {_USAGE}")
        gpu = gpu_memory = None
        it = iter(rest)
        for word in it:
            if word in ("--gpu", "--gpu-memory"):
                value = next(it, None)
                if value is None:
                    raise UsageError(f"%gpusim: {word} needs a value; {_USAGE}")
                if word == "--gpu":
                    gpu = value
                else:
                    gpu_memory = value
            else:
                raise UsageError(f"%gpusim: unknown option {word!r}; {_USAGE}")
        from .backends.sim.gpus import option_spelling

        try:
            target = resolve_target(gpu, gpu_memory, spell=option_spelling)
        except (ValueError, TypeError) as exc:
            raise UsageError(f"%gpusim: {exc}") from None
        self.on, self.gpu, self.gpu_memory = True, gpu, gpu_memory
        card = f"{target.name} ({target.total_memory / 2**30:.2f} GiB)" if target else "no target card"
        return (f"%gpusim on: every cell runs on the simulated GPU, {card}, with a one-line "
                "memory footer; %%gpumem cells give the full report; %gpusim off to stop")


def sim_mode(shell: Any) -> SimMode:
    """The SimMode of a shell (made and installed on first use)."""
    mode = getattr(shell, "_memmagic_sim_mode", None)
    if mode is None:
        mode = SimMode(shell)
        setattr(shell, "_memmagic_sim_mode", mode)
        mode.install()
    return mode


@contextlib.contextmanager
def suspended(shell: Any) -> Iterator[None]:
    """The mode's transformer off (while a magic compiles the cell body it runs)."""
    mode = getattr(shell, "_memmagic_sim_mode", None)
    if mode is None:
        yield
        return
    mode._busy += 1
    try:
        yield
    finally:
        mode._busy -= 1
