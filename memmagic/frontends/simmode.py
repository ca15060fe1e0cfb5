"""``%gpusim``: run every cell of a notebook on the simulated GPU.

``%gpusim on [--gpu T4] [--gpu-memory 10GiB]`` makes each following cell run as a
``%%gpumem --backend sim`` cell against the notebook's one simulated GPU (see
:mod:`memmagic.backends.sim.session`), with a one-line memory footer instead of the
full report; ``%%gpumem`` cells in that mode give the full report against the same GPU.
``%gpusim off`` goes back to real cells (code under it in the same cell runs for real);
a bare ``%gpusim on`` then resumes the card of before (``--gpu none``: no target card);
``%gpusim reset`` empties the simulated GPU; ``%gpusim`` alone says where things stand.

The mode works by an input transformer (IPython's ``input_transformers_cleanup``) that
puts ``%%gpumem --backend sim --footer`` in front of each cell; cells made only of
magics that run no code (``%run``, ``%time``, ``%timeit`` and ``%prun`` do), shell escapes
and comments, and cells that start with a cell magic, are left alone. While memmagic is
loaded, a traceback does not show the ``run_cell_magic('gpumem', ...)`` line such a cell
became: it starts at the user's code.
"""

from __future__ import annotations

import contextlib
import linecache
import shlex
from types import TracebackType
from typing import Any, Callable, Iterator

from ..core.patching import Patches

__all__ = ["SimMode", "sim_mode", "suspended"]

_USAGE = ("usage: %gpusim on [--gpu NAME|none] [--gpu-memory SIZE] | %gpusim off | %gpusim reset | "
          "%gpusim")


class SimMode:
    """The notebook-wide switch of one shell."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.on = False
        self.gpu: str | None = None
        self.gpu_memory: str | None = None
        self._busy = 0
        self._carried = False  # the transformer simulates the code after "%gpusim on"
        # (the package's load function, on, gpu, gpu_memory) at %unload_ext: resumed by the
        # load of a %reload_ext
        self._parked: tuple[Any, bool, str | None, str | None] | None = None
        self._tracebacks = Patches()  # the shell's traceback without the magic's call

    # -- the input transformer ---------------------------------------------------------
    def transform(self, lines: list[str]) -> list[str]:
        if self._busy:
            return lines
        code = [ln for ln in lines if ln.strip()]
        if code and _words(code[0]) == ["%gpusim", "off"]:
            return lines  # "%gpusim off" and code below it: that code runs for real
        switch = _switch_on(code[0]) if code else None
        if switch is not None:  # "%gpusim on" and code below it: that code is simulated too
            at = lines.index(code[0]) + 1
            rest = "".join(lines[at:])
            if not rest.strip() or all(_not_code(ln)
                                       for ln in lines[at:] if ln.strip()):
                return lines
            line = _magic_line(*self.card(*switch)).split(" ", 1)[1]
            self._carried = True
            return [*lines[:at], f"{_MAGIC_CALL} {line!r}, {rest!r})\n"]
        if not self.on or not code or code[0].lstrip().startswith("%%"):
            return lines
        if all(_not_code(ln) for ln in code):
            return lines
        if _only_memmagic("".join(lines), self.shell.user_ns):
            return lines  # a panel moved, a report read: memmagic's own objects run for real
        return [self.magic_line() + "\n", *lines]

    def magic_line(self) -> str:
        """The cell magic each cell runs under."""
        return _magic_line(self.gpu, self.gpu_memory)

    def card(self, gpu: str | None, gpu_memory: str | None) -> tuple[str | None, str | None]:
        """The (gpu, gpu_memory) a ``%gpusim on`` line means: the card it names; none
        named, the card of before (``%gpusim off``, then ``%gpusim on`` resumes the same
        T4); ``--gpu none``: no target card."""
        if gpu is None and gpu_memory is None:
            return self.gpu, self.gpu_memory
        return (None if gpu is not None and gpu.lower() == "none" else gpu), gpu_memory

    def install(self) -> None:
        """Put the transformer in place; after ``%reload_ext memmagic``, with the mode as it
        was (on, on the same card: the card's tensors and the user's objects never left)."""
        parked, self._parked = self._parked, None
        if parked is not None and parked[0] is not _load_function():  # the package re-ran
            self.on, self.gpu, self.gpu_memory = parked[1:]
        cleanup = self.shell.input_transformers_cleanup
        if self.transform not in cleanup:
            cleanup.append(self.transform)
        formatter = getattr(self.shell, "InteractiveTB", None)
        if formatter is not None and not len(self._tracebacks):
            self._tracebacks.set(formatter, "structured_traceback",
                                 _without_the_magic_call(formatter.structured_traceback,
                                                         formatter))

    def unload(self) -> None:
        """``%unload_ext memmagic``: cells run for real, and a later ``%load_ext`` starts
        with no card chosen; ``%reload_ext`` (this, the package run again, a load) resumes
        the mode (see :meth:`install`)."""
        self._parked = (_load_function(), self.on, self.gpu, self.gpu_memory)
        self.on = False
        self.gpu = self.gpu_memory = None
        self.uninstall()

    def uninstall(self) -> None:
        cleanup = self.shell.input_transformers_cleanup
        while self.transform in cleanup:
            cleanup.remove(self.transform)
        self._tracebacks.restore()

    def _code_after(self, line: str) -> bool:
        """Whether the running cell has code after this ``%gpusim`` line: code that was
        transformed before the mode was on, and would run for real."""
        result = getattr(getattr(self.shell, "displayhook", None), "exec_result", None)
        raw = getattr(getattr(result, "info", None), "raw_cell", None)
        return isinstance(raw, str) and _code_after_switch(raw, line)

    # -- the line magic ------------------------------------------------------------------
    def command(self, line: str) -> str:
        """Carry out ``%gpusim LINE``; the line to show."""
        from IPython.core.error import UsageError

        from ..backends import simulation_running
        from ..backends.sim import resolve_target, shell_session
        from .options import line_problem

        try:
            words = shlex.split(line)
        except ValueError as exc:  # a quote left open
            raise UsageError(f"%gpusim: {line_problem(exc)}") from None
        if not words or words == ["status"]:
            state = "on" if self.on else "off"
            return f"%gpusim is {state}; " + shell_session(self.shell).status()
        verb, rest = words[0], words[1:]
        if verb == "off" and not rest:
            self.on = False
            return "%gpusim off: cells run for real again (the simulated GPU keeps its tensors)"
        if verb == "reset" and not rest:
            held = shell_session(self.shell).reset()
            from ..report import format_bytes

            return f"the simulated GPU was emptied ({format_bytes(held)} freed)"
        if verb != "on":
            raise UsageError(f"%gpusim: unknown {' '.join(words)!r}; {_USAGE}")
        from ..backends.sim import option_spelling

        try:
            gpu, gpu_memory = _on_options(rest)
        except ValueError as exc:
            raise UsageError(f"%gpusim: {exc}") from None
        resumed = gpu is None and gpu_memory is None and (self.gpu or self.gpu_memory)
        gpu, gpu_memory = self.card(gpu, gpu_memory)
        try:
            target = resolve_target(gpu, gpu_memory, spell=option_spelling)
        except (ValueError, TypeError) as exc:
            raise UsageError(f"%gpusim: {exc}") from None
        self.on, self.gpu, self.gpu_memory = True, gpu, gpu_memory
        carried, self._carried = self._carried, False
        if not carried and self._code_after(line) and not simulation_running():
            raise UsageError("%gpusim on: the code after it in this cell did not run (it would "
                             "have run on the real CPU); run the cell again, or put %gpusim on "
                             "in a cell of its own")
        card = f"{target.name} ({target.total_memory / 2**30:.2f} GiB)" if target else "no target card"
        if resumed:
            card += " as before (--gpu NAME for another, --gpu none for none)"
        return (f"%gpusim on: every cell runs on the simulated GPU, {card}, with a one-line "
                "memory footer; %%gpumem cells give the full report; %gpusim off to stop")


# the line a %%gpumem cell becomes (IPython's transform of a cell magic, or this mode's)
_MAGIC_CALL = "get_ipython().run_cell_magic('gpumem',"


def _without_the_magic_call(structured: Callable[..., list[str]], formatter: Any
                            ) -> Callable[..., list[str]]:
    """The shell's traceback formatter, less the cell's frame where that frame is the
    ``run_cell_magic('gpumem', ...)`` call the cell became: a traceback of a simulated
    cell starts at the user's code, not at a line with the whole cell as a string."""

    def structured_traceback(etype, evalue, etb=None, tb_offset=None, context=5):
        offset = formatter.tb_offset if tb_offset is None else tb_offset
        if isinstance(etb, TracebackType):
            etb = _magic_call_cut(etb, offset)
        return structured(etype, evalue, etb, tb_offset, context)

    return structured_traceback


def _magic_call_cut(tb: TracebackType, offset: int) -> TracebackType:
    """``tb`` without the frame ``offset`` deep when that frame runs the magic's call with
    the user's code below it (the frames before it, the shell's own, are kept)."""
    before: list[TracebackType] = []
    at: TracebackType | None = tb
    for _ in range(offset):
        before.append(at)
        at = at.tb_next if at is not None else None
    if at is None or at.tb_next is None:
        return tb
    line = linecache.getline(at.tb_frame.f_code.co_filename, at.tb_lineno)
    if not line.lstrip().startswith(_MAGIC_CALL):
        return tb
    rest = at.tb_next
    for t in reversed(before):
        rest = TracebackType(rest, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return rest


def _on_options(words: list[str]) -> tuple[str | None, str | None]:
    """(gpu, gpu_memory) of the words after ``%gpusim on``; ValueError saying what to write."""
    from .options import check_card_options

    opts: dict[str, str] = {}
    it = iter(words)
    for word in it:
        if word not in ("--gpu", "--gpu-memory"):
            raise ValueError(f"unknown option {word!r}; {_USAGE}")
        value = next(it, None)
        if value is None:
            raise ValueError(f"{word} needs a value; {_USAGE}")
        opts[word] = value
    gpu, gpu_memory = opts.get("--gpu"), opts.get("--gpu-memory")
    check_card_options(gpu, gpu_memory, no_card="--gpu none for no target card")
    return gpu, gpu_memory


# line magics that run Python code: a cell of them is simulated like any code
_RUNS_CODE = ("%run", "%time", "%timeit", "%prun")


def _not_code(line: str) -> bool:
    """Whether a line of a cell runs no Python code of its own: a comment, a shell escape,
    a line magic other than those that run code (``%run script.py``)."""
    text = line.lstrip()
    if text.startswith(_RUNS_CODE) and text.split(None, 1)[0] in _RUNS_CODE:
        return False
    return text.startswith(("%", "!", "#"))


def _code_after_switch(cell: str, line: str) -> bool:
    """Whether ``cell`` has code after its ``%gpusim <line>`` line."""
    lines = cell.splitlines()
    for i, ln in enumerate(lines):
        if ln.strip().startswith("%gpusim") and ln.strip()[len("%gpusim"):].strip() == line.strip():
            return any(x.strip() and not _not_code(x) for x in lines[i + 1:])
    return False


def _only_memmagic(source: str, namespace: dict) -> bool:
    """Whether the code uses memmagic's own objects of the namespace (a what-if panel, a
    Cell, a report) and nothing else but builtins and names it binds itself: such a cell
    runs for real under %gpusim on (its re-runs simulate themselves; wrapped, they would be
    a simulation inside another)."""
    import ast
    import builtins

    from ..whatif.engine import namespace_reads

    try:
        used = namespace_reads(source)
        tree = ast.parse(source)
    except SyntaxError:
        return False
    # (a cell that imports a library works with it: ``import torch as _torch``; memmagic's
    # own API is memmagic's: ``import memmagic``, ``from memmagic import find_batch_size``)
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imports = any(m.split(".")[0] != "memmagic" for m in imported)
    if imports or not any(name in namespace for name in used) or any(ch in source for ch in "%!"):
        return False
    for name in used:
        if name in namespace:
            obj = namespace[name]
            home = getattr(obj, "__name__", "") if isinstance(obj, type(builtins)) \
                else type(obj).__module__
            # memmagic's results and engines; not the simulated objects standing for the
            # user's (memmagic.backends.sim's placeholders)
            if home.split(".")[0] != "memmagic" or home.startswith("memmagic.backends"):
                return False
        elif not hasattr(builtins, name):
            return False
    return True


def _magic_line(gpu: str | None, gpu_memory: str | None) -> str:
    opts = ""
    if gpu:
        opts += f" --gpu {shlex.quote(gpu)}"
    if gpu_memory:
        opts += f" --gpu-memory {shlex.quote(gpu_memory)}"
    return f"%%gpumem --backend sim --footer{opts}"


def _words(line: str) -> list[str]:
    """The words of a line, its comment left out."""
    return line.split("#", 1)[0].split()


def _switch_on(line: str) -> tuple[str | None, str | None] | None:
    """(gpu, gpu_memory) of a ``%gpusim on ...`` line; None for any other line (or one
    whose options do not parse: the magic itself then says what is wrong)."""
    words = _words(line)
    if words[:2] != ["%gpusim", "on"]:
        return None
    try:  # the values as the magic reads them: --gpu "T4" is T4
        words = shlex.split(line.split("#", 1)[0])
    except ValueError:  # a quote left open: the magic's line, run first, says so
        pass
    opts = dict(zip(words[2::2], words[3::2]))
    if len(words[2:]) % 2 or set(opts) - {"--gpu", "--gpu-memory"}:
        return None
    return opts.get("--gpu"), opts.get("--gpu-memory")


def _load_function() -> Any:
    """memmagic's ``load_ipython_extension`` now: a new function once ``%reload_ext`` has run
    the package again."""
    import sys

    return getattr(sys.modules.get(__name__.partition(".")[0]), "load_ipython_extension", None)


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
