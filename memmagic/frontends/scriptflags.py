"""The knob options a script takes on its own command line (``--batch_size 16``): those its
command line gives, and those it takes but was not given, found while it runs.

A script given ``--batch_size 64`` takes the batch knob there (:func:`given_flags`). One
given none may still take one, at a default of its own; :class:`FlagWatch` finds it in the
script's first run, two ways:

- an ``argparse`` parser the script builds defines the option (``--batch-size``, or any
  option whose ``dest`` is ``batch_size``, or transformers' ``per_device_train_batch_size``
  that ``HfArgumentParser`` makes of ``TrainingArguments``): the value it parsed is the
  script's;
- code run with the script's own globals reads its arguments, and the script ends that run
  with an ``int`` global of the knob's name: nanoGPT's and llama2.c's configurator
  (``exec(open("configurator.py").read())``), which sets a global from ``--batch_size=N``.

A value passed to a found option is checked after each run (:meth:`FlagWatch.honoured`):
the script's own value must be the one passed.

A script with no option for a knob may set it as a plain number at its top level, once
(``batch_size = 64`` among the hyperparameters of karpathy's ng-video-lecture ``gpt.py``):
:class:`memmagic.whatif.literals.Numbers` finds it in the source, and a run given another
value runs the script's code with the number at that line replaced (the file is not
changed)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from ..core.patching import Patches

__all__ = ["FlagWatch", "given_flags", "flag_value", "with_flag_value", "passed_values"]


def given_flags(argv: Sequence[str]) -> dict[str, str]:
    """knob variable -> the option of ``argv`` that gives it a whole number, as written: one
    of :attr:`Knob.script_flags` (``--batch_size 16``), or a config's dotted key named as
    the knob's variable or one of :attr:`Knob.option_dests` (minGPT's
    ``--trainer.batch_size=512``, a Hydra override ``data.block_size=64``; of several for
    one knob, the one ``option_dests`` lists first). An option of another name
    (``--device-batch-size``) is the knob's where the script's argparse defines it
    (:class:`FlagWatch`, which checks that each run took the value passed)."""
    out: dict[str, tuple[int, str]] = {}
    for i, a in enumerate(argv):
        flag, eq, value = a.partition("=")
        if not a.startswith("-"):
            if not eq or "." not in flag or not flag[:1].isalpha():
                continue  # a positional argument; a Hydra key=value override is dotted
        elif not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if not value.isdigit():
            continue
        dotted = "." in flag
        name = flag.lstrip("-").rsplit(".", 1)[-1].replace("-", "_")
        for knob in _sized_knobs():
            dests = knob.option_dests
            if not (flag in knob.script_flags or dotted and name in dests):
                continue
            rank = dests.index(name)
            if knob.var not in out or rank < out[knob.var][0]:
                out[knob.var] = (rank, flag)
    return {var: flag for var, (_, flag) in out.items()}


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value ``argv`` gives ``flag`` (``--f V`` or ``--f=V``), or None."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1:]
    return None


def with_flag_value(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag`` at ``value``: where it is given, in its place; else added at
    the end as ``--f=V`` (the form argparse and a configurator both take)."""
    out = list(argv)
    found = False
    for i, a in enumerate(out):
        if a == flag and i + 1 < len(out):
            out[i + 1], found = value, True
        elif a.startswith(flag + "="):
            out[i], found = f"{flag}={value}", True
    return out if found else [*out, f"{flag}={value}"]


def passed_values(ns: dict, variables: Any) -> dict[str, int]:
    """The whole numbers ``ns`` holds for ``variables`` (the knob values a run passes)."""
    return {var: ns[var] for var in variables if _is_int(ns.get(var))}


def _sized_knobs() -> list[Any]:
    from ..whatif.knobs import KNOBS

    return [knob for knob in KNOBS.values() if knob.script_flags]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Argv(list):
    """``sys.argv`` for a run: a list that notes when code run with the script's globals
    reads its arguments (a slice or a loop over it)."""

    watch: "FlagWatch"

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            self.watch.read_from(sys._getframe(1))
        return list.__getitem__(self, i)

    def __iter__(self) -> Any:
        self.watch.read_from(sys._getframe(1))
        return list.__iter__(self)

    def __reduce__(self) -> Any:
        # a plain list where it is pickled or copied (multiprocessing's spawn sends its
        # children sys.argv): never the watch and the script's globals it holds
        return list, (list(self),)


class FlagWatch:
    """One run of a script (its globals ``ns``): the knob options its argparse parsers
    parsed (knob variable -> (option, value)) and whether code run with its globals read
    its arguments. ``install(patches, argv)`` sets ``sys.argv`` and watches argparse until
    ``patches`` are restored."""

    def __init__(self, ns: dict) -> None:
        self.ns = ns
        self.parsed: dict[str, tuple[str, Any]] = {}
        self.argv_read = False

    def install(self, patches: Patches, argv: list[str]) -> None:
        watched = _Argv(argv)
        watched.watch = self
        patches.set(sys, "argv", watched)
        parse = argparse.ArgumentParser.parse_known_args
        watch = self

        def parse_known_args(parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
            result = parse(parser, *args, **kwargs)
            watch.parsed_by(parser, result[0])
            return result
        patches.set(argparse.ArgumentParser, "parse_known_args", parse_known_args)

    def read_from(self, frame: Any) -> None:
        if frame is not None and frame.f_globals is self.ns:
            self.argv_read = True

    def parsed_by(self, parser: argparse.ArgumentParser, namespace: Any) -> None:
        """Note the knob options ``parser`` defines and the values it parsed (of several
        options for one knob, the one :attr:`Knob.option_dests` lists first: the batch
        one device takes in a step before a global one)."""
        for knob in _sized_knobs():
            dests, best = knob.option_dests, None
            for action in getattr(parser, "_actions", ()):
                names = [s for s in action.option_strings if s.startswith("--")]
                if set(names) & set(knob.script_flags):
                    rank = dests.index(knob.var)
                elif names and action.dest in dests:
                    rank = dests.index(action.dest)
                else:
                    continue
                value = getattr(namespace, action.dest, None)
                if _is_int(value) and (best is None or rank < best[0]):
                    flag = next((s for s in knob.script_flags if s in names), max(names, key=len))
                    best = (rank, flag, value)
            if best is not None:
                self.parsed[knob.var] = best[1:]

    def found(self, given: dict[str, str]) -> dict[str, tuple[str, int]]:
        """The knob options the script takes that ``given`` (its command line's) lacks:
        knob variable -> (option, the value the run had). Where code run with the script's
        globals read its arguments (a configurator), a whole-number global of the knob's
        variable or of one of :attr:`Knob.option_dests` (nanoGPT's ``block_size``, the
        context), the first the list names, is taken as ``--name=N``."""
        out = {var: fv for var, fv in self.parsed.items() if var not in given}
        if self.argv_read:
            for knob in _sized_knobs():
                if knob.var in given or knob.var in out:
                    continue
                dest = next((d for d in knob.option_dests if _is_int(self.ns.get(d))), None)
                if dest is not None:
                    out[knob.var] = ("--" + dest, self.ns[dest])
        return out

    def honoured(self, var: str, flag: str, value: int) -> bool:
        """Whether the run took ``value`` for ``var``, passed as ``flag`` (the script's
        own value is it: the option's, else the global the flag names)."""
        if var in self.parsed:
            return self.parsed[var][1] == value
        return self.ns.get(flag.lstrip("-").replace("-", "_")) == value
