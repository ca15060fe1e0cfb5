"""A Python script run as ``python script.py`` would run it, inside memmagic's pipeline: the
run function of ``python -m memmagic run`` (:class:`ScriptRun`).

Each run (the first, and the doctor's and the what-if engine's re-runs) starts from a
fresh ``__main__`` with the script's argv and folder on ``sys.path``, over a fresh
:class:`~memmagic.frontends.scratchdisk.ScratchDisk`, and can be cut short: after ``steps``
optimizer steps (forward passes when the script makes no optimizer), or at a time limit.
A line on stderr every ``progress_every_s`` seconds says how far a long run got."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import threading
import time
import tokenize
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ..core.failures import out_of_memory_behind
from ..core.patching import Patches
from .scratchdisk import ChangeSummary, ScratchDisk
from ..whatif.literals import Numbers
from .scriptflags import FlagWatch, flag_value, given_flags, passed_values, with_flag_value

__all__ = ["ScriptRun", "ScriptError", "RunProgress", "StepsDone", "load_script", "find_module"]

_GRACE_S = 1.0  # after the time limit, how long a clean cut (at a step or forward) may take
_RETRY_S = 0.05  # then how often the alarm looks for the script's own code


class StepsDone(BaseException):
    """Raised where the run is cut (``steps`` reached, time up): a BaseException, so the
    script's own ``except Exception`` does not catch it."""


class ScriptError(ValueError):
    """A script that cannot run at all (it does not compile, or is not text); the message
    is one line that says where and what to do."""


def load_script(path: Path) -> tuple[str, types.CodeType]:
    """The script's source and code, read as Python reads it (UTF-8 unless its first
    lines declare an encoding). ScriptError says what is wrong."""
    data = path.read_bytes()
    try:
        encoding = _encoding(data)
        source = data.decode(encoding)
        return source, compile(source, str(path), "exec", dont_inherit=True)
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ScriptError(
            f"{path} line {line}: byte {data[exc.start]:#04x} is not {exc.encoding} text: save "
            "the script as UTF-8, or declare its encoding on its first line "
            "(# -*- coding: latin-1 -*-)") from None
    except SyntaxError as exc:
        where = f"{path} line {exc.lineno}" if exc.lineno else str(path)
        raise ScriptError(f"{where}: {exc.msg}: fix the script (python {path} stops there "
                          "too)") from None
    except ValueError as exc:  # a NUL byte
        raise ScriptError(f"{path}: {exc}: is it a Python script?") from None


def find_module(name: str, argv: Sequence[str] = ()) -> tuple[Path, Any]:
    """The file ``python -m name`` runs (a package's ``__main__``) and its module spec;
    ScriptError says what is wrong. Its parent packages are imported, as ``python -m``
    imports them: with the current folder first on ``sys.path`` and ``sys.argv`` ``["-m",
    *argv]`` (a package that reads its arguments on import, as a default value, sees the
    module's, not memmagic's)."""
    import importlib.util

    patches = Patches()
    sys.path.insert(0, os.getcwd())
    try:
        patches.set(sys, "argv", ["-m", *argv])
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{name}.__main__")  # a package: its __main__
    except (ImportError, ValueError) as exc:
        raise ScriptError(f"-m {name}: {type(exc).__name__}: {exc}") from None
    finally:
        patches.restore()
        sys.path.remove(os.getcwd())
    if spec is None or not spec.origin or not spec.has_location or not spec.origin.endswith(".py"):
        raise ScriptError(f"-m {name}: no Python module of that name here (python -m {name} "
                          "would fail too): check the name, or run from the folder above it")
    return Path(spec.origin), spec


def _encoding(data: bytes) -> str:
    """The encoding the script declares (PEP 263), UTF-8 by default; when its first lines
    are no text in it, UTF-8, whose decoding error then says where."""
    try:
        return tokenize.detect_encoding(io.BytesIO(data).readline)[0]
    except SyntaxError as exc:
        if "unknown encoding" in str(exc):
            raise
        return "utf-8"


@dataclass
class RunProgress:
    """How far one run of the script got, and what ended it (``cut``: "steps", "forwards",
    "time", or None when the script ended by itself)."""

    steps: int = 0  # optimizer steps
    forwards: int = 0  # outermost calls of modules with parameters (not layers, not losses)
    no_grad_forwards: int = 0  # those of them with gradients off (evaluation)
    seconds: float = 0.0
    made_optimizer: bool = False
    cut: str | None = None

    def __str__(self) -> str:
        return (f"{self.seconds:.0f} s, {self.steps} optimizer step(s), "
                f"{self.forwards} forward pass(es)")


class _ScriptModule(types.ModuleType):
    """The script's ``__main__`` module over its namespace dict, as ``sys.modules``
    holds it for the run: pickle finds the script's functions and classes there by name
    (multiprocessing sends them so to its workers)."""

    def __init__(self, namespace: dict) -> None:
        super().__init__("__main__")
        vars(self)["__namespace__"] = namespace

    def __getattr__(self, name: str) -> Any:
        try:
            return vars(self)["__namespace__"][name]
        except KeyError:
            raise AttributeError(f"module '__main__' has no attribute {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        vars(self)["__namespace__"][name] = value

    def __dir__(self) -> list[str]:
        return list(vars(self)["__namespace__"])


class _Watch:
    """Counts one run's optimizer steps (outermost: an optimizer stepping others makes one)
    and forward passes (outermost calls of a module
    with parameters: a model's, not its layers' nor a loss module's), and cuts the run: at
    ``steps`` optimizer steps; when the script made no optimizer (an evaluation loop),
    after ``steps`` forward passes, at the next one (a training script that evaluates
    before its first step has made its optimizer by then); at the time limit (see
    :meth:`_alarm`). Only in the process that started the run (a forked worker carries
    on)."""

    def __init__(self, steps: int | None, limit_s: float | None, script_file: str,
                 progress_every_s: float) -> None:
        self.steps, self.limit_s, self.script_file = steps, limit_s, script_file
        self.every_s = progress_every_s
        self.progress = RunProgress()
        self.started = time.monotonic()
        self.depth = 0  # module calls under way
        self.stepping = 0  # optimizer steps under way (one inside another)
        self.counted = False  # whether the outermost one is a forward pass
        self.no_grad = False  # whether it runs with gradients off
        self._grad_enabled: Callable[[], bool] = lambda: True  # torch's, while watching
        self.expired = False
        self.pid = os.getpid()

    def _cut(self, reason: str) -> None:
        if os.getpid() == self.pid:
            self.progress.cut = reason
            raise StepsDone(reason)

    def _time_up(self) -> bool:
        if not self.expired and self.limit_s is not None:
            self.expired = time.monotonic() - self.started >= self.limit_s
        return self.expired

    def before_step(self, *_: Any) -> None:
        self.stepping += 1

    def on_step(self, *_: Any) -> None:
        # an optimizer that steps others (torchtitan's OptimizersContainer, ZeRO's local
        # optimizer) makes one step: the outermost counts, and a cut waits for it
        self.stepping = max(0, self.stepping - 1)
        if self.stepping:
            return
        self.progress.steps += 1
        if self.steps is not None and self.progress.steps >= self.steps:
            self._cut("steps")
        if self._time_up():
            self._cut("time")

    def before_forward(self, module: Any, args: Any) -> None:
        if self.depth == 0:
            if self._time_up():
                self._cut("time")
            # a model's call counts, a loss module's (no parameters) does not
            self.counted = next(module.parameters(), None) is not None
            self.no_grad = not self._grad_enabled()
            p = self.progress
            if (self.counted and self.steps is not None and not p.made_optimizer
                    and p.forwards >= self.steps):
                self._cut("forwards")
        self.depth += 1

    def after_forward(self, module: Any, args: Any, output: Any) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth == 0 and self.counted:
            self.progress.forwards += 1
            self.progress.no_grad_forwards += self.no_grad

    def _alarm(self, signum: int, frame: Any) -> None:
        """SIGALRM: the time is up. A step or forward pass within a second cuts the run
        there; after that the alarm cuts it at a line of the script's own code (never
        inside memmagic's or torch's, which would be left half-way), looking again every
        50 ms."""
        if not self.expired:
            self.expired = True
            signal.setitimer(signal.ITIMER_REAL, _GRACE_S)
        elif frame is not None and frame.f_code.co_filename == self.script_file:
            self._cut("time")
        else:
            signal.setitimer(signal.ITIMER_REAL, _RETRY_S)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """The counters, the alarm and the progress lines, for the run; all removed after."""
        import torch
        from torch.nn.modules.module import (register_module_forward_hook,
                                             register_module_forward_pre_hook)
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)

        patches = Patches()
        self._grad_enabled = torch.is_grad_enabled
        try:
            for handle in (register_optimizer_step_pre_hook(self.before_step),
                           register_optimizer_step_post_hook(self.on_step),
                           register_module_forward_pre_hook(self.before_forward),
                           register_module_forward_hook(self.after_forward, always_call=True)):
                patches.call_on_restore(handle.remove)
            init = torch.optim.Optimizer.__init__

            def counted_init(optimizer: Any, *args: Any, **kwargs: Any) -> None:
                self.progress.made_optimizer = True
                init(optimizer, *args, **kwargs)
            patches.set(torch.optim.Optimizer, "__init__", counted_init)
            self._arm(patches)
            self._report_progress(patches)
            yield
        finally:
            self.progress.seconds = time.monotonic() - self.started
            patches.restore()

    def _arm(self, patches: Patches) -> None:
        """The time limit's alarm (main thread only; elsewhere the hooks alone cut)."""
        if (self.limit_s is None or not hasattr(signal, "setitimer")
                or threading.current_thread() is not threading.main_thread()):
            return
        old = signal.signal(signal.SIGALRM, self._alarm)
        patches.call_on_restore(lambda: signal.signal(signal.SIGALRM, old))
        patches.call_on_restore(lambda: signal.setitimer(signal.ITIMER_REAL, 0))
        signal.setitimer(signal.ITIMER_REAL, self.limit_s)

    def _report_progress(self, patches: Patches) -> None:
        stop = threading.Event()

        def report() -> None:
            while not stop.wait(self.every_s):
                self.progress.seconds = time.monotonic() - self.started
                print(f"memmagic: {os.path.basename(self.script_file)} running: "
                      f"{self.progress}", file=sys.stderr, flush=True)
        thread = threading.Thread(target=report, name="memmagic-progress", daemon=True)
        thread.start()
        patches.call_on_restore(thread.join)
        patches.call_on_restore(stop.set)


class ScriptRun:
    """``run(namespace)``: the script as ``__main__``, with its argv and folder on sys.path
    (as ``python script.py`` sets them), cut after ``steps`` optimizer steps (or forward
    passes, see :class:`_Watch`) or ``time_limit_s`` seconds. ``progress``: how far the
    last run got; ``changes``: what the runs changed on their scratch disks (net of each
    run, none of it on the disk). Everything set for a run is put back in ``finally``."""

    progress_every_s = 10.0

    def __init__(self, code: types.CodeType, path: Path, argv: list[str], steps: int | None = None,
                 time_limit_s: float | None = None, module: Any = None,
                 source: str | None = None) -> None:
        self.code, self.path, self.argv = code, path, argv
        self.module = module  # the spec of a module run as ``python -m`` runs it, or None
        self.steps, self.time_limit_s = steps, time_limit_s
        self.progress = RunProgress()
        self.changes = ChangeSummary()
        # knob variables the script takes from its command line (``--batch_size 16``): the
        # what-if engine and the doctor set them in the namespace, the run puts them in argv;
        # ``found``: those its first run showed it takes though argv gives none (variable ->
        # (option, the value it ran with))
        self.flags = given_flags(argv)
        self.found: dict[str, tuple[str, int]] = {}
        # knob variables the script's top level sets to a number (``batch_size = 64``) and
        # takes on no command-line option: (line, value); a run given another value runs
        # the script's code with that number replaced (``source``: its text)
        self.numbers = Numbers(source, lambda text: compile(text, code.co_filename, "exec",
                                                             dont_inherit=True))
        self.assigned = self.numbers.at
        self.knob_reads = frozenset(self.flags) | frozenset(self.assigned)
        self._runs = 0
        # the code of the first run's sys.exit() on an out of memory it caught (None:
        # none); each run that exits so ends in that out of memory, as its report
        self.exited_on_oom: Any = None
        self.base: dict[str, Any] = {"__name__": "__main__", "__file__": str(path),
                                     "__builtins__": __builtins__}
        if module is not None:  # its relative imports resolve in its package
            self.base.update(__spec__=module, __package__=module.parent)

    def initial_values(self) -> dict[str, int]:
        """The knob variables' values as the command line gives them (or the script's top
        level sets them: :meth:`assigned_only`)."""
        given = {var: int(flag_value(self.argv, flag)) for var, flag in self.flags.items()
                 if var not in self.found}
        return {**{var: value for var, (_, value) in self.assigned_only().items()}, **given,
                **{var: value for var, (_, value) in self.found.items()}}

    def assigned_only(self) -> dict[str, tuple[int, int]]:
        """The variables of :attr:`assigned` that no command-line option gives (an option
        the script takes wins: it may set the variable after that line)."""
        return {var: lv for var, lv in self.assigned.items() if var not in self.flags}

    def _argv(self, passed: dict[str, int]) -> list[str]:
        argv = list(self.argv)
        for var, value in passed.items():
            argv = with_flag_value(argv, self.flags[var], str(value))
        return argv

    def __call__(self, ns: dict) -> None:
        # each run (the doctor's and the what-if re-runs too) starts from a fresh __main__,
        # as `python script.py` does, with the knob values it is given
        keep = {var: ns[var] for var in self.knob_reads if var in ns}
        ns.clear()
        ns.update(self.base)
        ns.update(keep)
        watch = _Watch(self.steps, self.time_limit_s, self.code.co_filename,
                       self.progress_every_s)
        how = f"python -m {self.module.name}" if self.module is not None else f"python {self.path}"
        disk = ScratchDisk(for_real=how)
        patches = Patches()
        flags = FlagWatch(ns)
        passed = passed_values(ns, self.flags)
        set_at = passed_values(ns, self.assigned_only())
        code = self.numbers.compiled(set_at) or self.code
        oom = None  # the out of memory a nonzero sys.exit() followed
        try:
            flags.install(patches, [str(self.path), *self._argv(passed)])
            saved_path = list(sys.path)
            patches.call_on_restore(lambda: sys.path.__setitem__(slice(None), saved_path))
            # python script.py puts the script's folder first; python -m, the current one
            sys.path.insert(0, os.getcwd() if self.module is not None else str(self.path.parent))
            patches.set_item(sys.modules, "__main__", _ScriptModule(ns))
            with watch.watching(), disk.installed():
                exec(code, ns)
        except StepsDone:
            pass
        except SystemExit as exc:  # the script's own sys.exit() / argparse's
            if exc.code not in (None, 0):
                self._flags_after(flags, passed, set_at, exc)
                oom = out_of_memory_behind(exc)
                if oom is None:
                    raise
                if self._runs == 1:  # the run as written (the report's)
                    self.exited_on_oom = exc.code
        except BaseException as exc:
            self._flags_after(flags, passed, set_at, exc)
            raise
        finally:
            patches.restore()
            self.progress = watch.progress
            self.changes = self.changes | disk.summary
        if oom is not None:  # raised here, not in the except: no cycle of contexts
            raise oom
        self._flags_after(flags, passed, set_at, None)

    def _flags_after(self, flags: FlagWatch, passed: dict[str, int], set_at: dict[str, int],
                     error: BaseException | None) -> None:
        """After a run (``error``: what it raised): the first one tells which knob options
        the script takes though its command line gives none; a later one that did not take
        a value it passed to one of those, or that changed a top-level number it set
        (``set_at``), raises :class:`ScriptError` in place of its own outcome (a Ctrl-C
        stays a Ctrl-C)."""
        self._runs += 1
        if self._runs == 1:
            self.found = flags.found(self.flags)
            self.flags.update({var: flag for var, (flag, _) in self.found.items()})
            self.knob_reads = frozenset(self.flags) | frozenset(self.assigned)
            return
        if isinstance(error, KeyboardInterrupt):
            return
        for var, value in passed.items():
            if var in self.found and not flags.honoured(var, self.flags[var], value):
                raise ScriptError(
                    f"the script did not take {self.flags[var]}={value} (memmagic read "
                    f"{self.flags[var]} as its option for {var}, from its first run): give "
                    f"the script its {var} on its own command line") from error
        for var, value in set_at.items():
            # (a settings dict's entry has no variable to look at: its value is the dict's)
            if var not in self.numbers.keyed and flags.ns.get(var) != value:
                line = self.assigned[var][0]
                raise ScriptError(
                    f"the script changed {var} after line {line} (memmagic set {var} = "
                    f"{value} there): give the script its {var} on its own command line") from error
