"""The decode steps of transformers' ``generate()``, read off a line instead of run op by op.

After its prefill, ``generate()`` calls the model once per new token, and those calls
differ only in the cache length ``L``: a decode step of a 1.1B Llama makes some 1,100
allocations, the same ones in the same order at every ``L``, each of a size ``a + b*L``
(the cache's keys and values grow by one position, the attention scores by one column).
Simulating each op of each step costs about 0.2 s a token; this module runs three decode
steps in a row, fits every allocation's size on the line through the first two and checks
the third against it, byte for byte. Then, up to the last step:

* each later step is **evaluated**: its allocations and frees, sizes read off the line,
  are done in order on the allocator model (its allocated and reserved bytes, segments and
  cache move exactly as the step's would); the tensors the step leaves behind (the cache's
  new keys and values, the logits) are made at their places as simulated tensors of the
  line's shapes, and the cache's old ones dropped where the step drops them;
* steps **run** op by op as checks: after 16 evaluated steps, then after 32, 64, ..., and
  the last one; each must do what the line says (the note says whether it did), and one
  that does not starts a new line through itself and the next two. The run's peaks,
  breakdown and module rows come from the last step (every size grows with ``L``, so no
  evaluated step reaches them);
* a step the line says runs out of memory is run instead (the error is then the op's own);
* a cache with a sliding window of ``W`` (its ``sliding_window``) is read off up to the step
  before it fills, which runs as a check; from there its tensors are views of longer ones,
  and the steps run op by op.

An encoder-decoder's steps (T5's, in the tests) pass on the encoder output they are
given. Only ``_sample`` (greedy and sampling decoding) is read off, when the stopping
criteria are the length and the end-of-sequence token (a simulation reads no token, so
every call makes all its tokens); beam search, assisted decoding, other criteria and
caches that hold tensors where they cannot be replaced run every step, and a note says
so. The cache length is counted from the prompt (a static cache's ``get_seq_length()``
reads its values). ``SimBackend(decode="run")`` runs every step of every call. What an evaluated step leaves out: its ops (the op count, the
trace and the timeline show the cache tensors it made, not its transient buffers) and
the values a GPU run would compute.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...core import _torch_private as _priv
from ...core.interrupts import atomic
from ...core.patching import Patches
from ...core.snapshot import evaluated_keys
from .allocator import round_request, segment_size

if TYPE_CHECKING:
    from .tracker import SimTracker

__all__ = ["decode_targets", "whole"]

_CHECKED = 3  # real steps in a row before the line is used: drawn through two, checked by the third
_FIRST_CHECK = 16  # evaluated steps before the first that runs as a check (then 32, 64, ...)
_CRITERIA = frozenset({"MaxLengthCriteria", "EosTokenCriteria"})  # none reads a token's value
# generate()'s other decoding methods: they run every step (a note says so)
_NOT_READ = {"_beam_search": "beam search", "_assisted_decoding": "assisted decoding"}
# beam search reads whether a beam is still open off the beams' scores and finished flags,
# values a simulation has not: as for sampling (no end-of-sequence token is read), no beam
# is taken to end before the maximum length ends them all (with steps read off or not)
_BEAMS_OPEN = ("no beam was taken to end before the maximum length (a simulation reads no "
               "token, so no end-of-sequence), so every step ran and its sequences are "
               "max_length long")
_MODULE = "transformers.generation.utils"
# what a decode step's new token comes in (an encoder-decoder's decoder takes its own)
_TOKENS = ("input_ids", "decoder_input_ids", "inputs_embeds", "decoder_inputs_embeds")
_EMPTY = torch.ops.aten.empty.memory_format  # a tensor a step leaves (its values unknown)
_DEPTH = 3  # how deep the cache's attributes are searched for tensors


def _buffers(length: int, count: int) -> list[int]:
    """The allocator model's keys of an evaluated step's ``count`` transient buffers at cache
    length ``length``, with the frames a memory snapshot shows for them."""
    return evaluated_keys("<generate() decode step, evaluated>", length,
                          "decode step at cache length", count)


class _Unsupported(Exception):
    """A step this module cannot read off (the reason is its message)."""


# -- where the cache keeps its tensors ---------------------------------------------------------
def _walk(obj: Any, path: tuple = (), depth: int = 0):
    """(path, value) for each tensor and int reachable from a cache object through its
    attributes, lists and dicts (``path``: ("a", name) / ("i", index) / ("k", key) steps)."""
    if isinstance(obj, torch.Tensor) or (isinstance(obj, int) and not isinstance(obj, bool)):
        yield path, obj
        return
    if depth > _DEPTH:
        return
    if isinstance(obj, list):
        items = [(("i", i), v) for i, v in enumerate(obj)]
    elif isinstance(obj, dict):
        items = [(("k", k), v) for k, v in obj.items()]
    elif isinstance(obj, tuple):
        if any(isinstance(v, torch.Tensor) for v in obj):
            raise _Unsupported("the cache holds tensors in a tuple (they cannot be replaced)")
        return
    elif type(obj).__module__.startswith("transformers.") and hasattr(obj, "__dict__"):
        items = [(("a", k), v) for k, v in vars(obj).items()]
    else:
        return
    for step, value in items:
        yield from _walk(value, path + (step,), depth + 1)


def _put(obj: Any, path: tuple, value: Any) -> None:
    for kind, name in path[:-1]:
        obj = getattr(obj, name) if kind == "a" else obj[name]
    kind, name = path[-1]
    if kind == "a":
        setattr(obj, name, value)
    else:
        obj[name] = value


# -- one step, as it ran ------------------------------------------------------------------------
@dataclass
class _Step:
    """A decode step that ran: its allocator actions as codes (``("a", k)`` / ``("f", k)``: a
    transient buffer's alloc and free; ``("s", slot)``: the alloc of a tensor the step
    leaves in ``slot``; ``("p", slot)``: the free of the one the slot held before), the
    requested bytes of each alloc, and what the step left: each slot's tensor's shape and
    (dtype, device), the cache's ints, and the output's type and fields (``("cache",)``, a
    slot, or ``("value", v)``)."""

    length: int
    codes: tuple
    sizes: list[int]
    shapes: dict[tuple, tuple]
    kinds: dict[tuple, tuple]
    ints: dict[tuple, int]
    out_type: type
    fields: dict[str, tuple]


def _serials(tracker: SimTracker, cache: Any) -> tuple[dict[int, tuple], dict[tuple, int]]:
    """Serial -> slot of the cache's tensors, and slot -> int of its ints."""
    serials, ints = {}, {}
    for path, value in _walk(cache):
        if isinstance(value, torch.Tensor):
            serial = tracker.serial_of(value)
            if serial is not None:
                serials[serial] = ("cache", path)
        else:
            ints[path] = value
    return serials, ints


def _inputs(kwargs: dict) -> dict[int, tuple]:
    """id -> where in a step's keyword arguments, of the tensors it was given (directly, or
    in a tuple or a transformers ModelOutput: an encoder-decoder's ``encoder_outputs``)."""
    found = {}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            found[id(value)] = (name,)
        elif isinstance(value, tuple) or type(value).__module__.startswith("transformers."):
            items = enumerate(value) if isinstance(value, tuple) else getattr(value, "items", list)()
            for key, item in items:
                if isinstance(item, torch.Tensor):
                    found[id(item)] = (name, key)
    return found


def _given(kwargs: dict, where: tuple) -> Any:
    value = kwargs[where[0]]
    return value if len(where) == 1 else value[where[1]]


def _left(tracker: SimTracker, out: Any, cache: Any, given: dict[int, tuple]
          ) -> tuple[dict, dict, dict, dict, dict]:
    """What a step left: serial -> slot (the cache's tensors and the output's), each
    slot's shape and (dtype, device), the cache's ints, and the output's fields (an output
    tensor the step was given, ``given``: where in its arguments)."""
    serials, ints = _serials(tracker, cache)
    fields: dict[str, Any] = {}
    if not hasattr(out, "items"):
        raise _Unsupported(f"the model returned a {type(out).__name__}, not a ModelOutput")
    for name, value in out.items():
        if value is cache:
            fields[name] = ("cache",)
        elif id(value) in given:  # an encoder-decoder's encoder output, passed through
            fields[name] = ("given", given[id(value)])
        elif isinstance(value, torch.Tensor):
            serial = tracker.serial_of(value)
            if serial is None or not whole(value):
                raise _Unsupported(f"the output's {name} is not a tensor of its own")
            serials[serial] = fields[name] = ("out", name)
        elif isinstance(value, (tuple, list, dict)):
            raise _Unsupported(f"the output's {name} holds several tensors")
        else:
            fields[name] = ("value", value)
    tensors = {("cache", p): v for p, v in _walk(cache) if isinstance(v, torch.Tensor)}
    for t in tensors.values():
        if not whole(t):
            raise _Unsupported("the cache keeps views of larger tensors (a sliding window)")
    tensors.update({("out", n): out[n] for n, f in fields.items() if f[0] == "out"})
    shapes = {slot: tuple(t.shape) for slot, t in tensors.items()}
    kinds = {slot: (t.dtype, t.device) for slot, t in tensors.items()}
    return serials, shapes, kinds, ints, fields


def _field(field: tuple, cache: Any, made: dict, kwargs: dict) -> Any:
    """An evaluated step's output field: the cache, a tensor it made, one it was given, or
    a plain value."""
    kind = field[0]
    if kind == "cache":
        return cache
    if kind == "out":
        return made[field]
    return _given(kwargs, field[1]) if kind == "given" else field[1]


def whole(t: torch.Tensor) -> bool:
    """Whether ``t`` is its storage, all of it, in order (what a step's or an evaluated
    call's new tensor is)."""
    return (t.is_contiguous() and not t.storage_offset()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _codes(entries: list[dict], before: dict[int, tuple], after: dict[int, tuple]
           ) -> tuple[tuple, list[int]]:
    """A step's allocator entries as codes and alloc sizes (see :class:`_Step`)."""
    freed = {e["key"] for e in entries if e["action"] == "free_completed"}
    transient: dict[Any, int] = {}
    codes, sizes = [], []
    for e in entries:
        action, key = e["action"], e["key"]
        if action == "alloc":
            slot = after.get(key)
            if slot is not None and key not in freed:
                codes.append(("s", slot))
            else:
                codes.append(("a", transient.setdefault(key, len(transient))))
            sizes.append(e["size"])
        elif action == "free_completed":
            if key in transient:
                codes.append(("f", transient[key]))
            elif key in before:
                codes.append(("p", before[key]))
            else:
                raise _Unsupported("a step frees memory that its cache did not hold")
        elif action == "oom":
            raise _Unsupported("a step ran out of memory")
    left = {slot for slot in after.values()} - {c[1] for c in codes if c[0] == "s"}
    if any(slot[0] == "out" for slot in left):
        raise _Unsupported("the output holds a tensor made before the step")
    return tuple(codes), sizes


# -- three steps on one line ---------------------------------------------------------------------
def _line(v1: list[int], v2: list[int], v3: list[int], x: int, grow: bool = True
          ) -> list[tuple[int, int]]:
    """(a, b) of each value on the line ``a + b*L`` through ``v1`` at ``x`` and ``v2`` at
    ``x + 1``, checked by ``v3`` at ``x + 2``; ``grow``: no value may shrink as ``L`` grows."""
    out = []
    for y1, y2, y3 in zip(v1, v2, v3):
        b = y2 - y1
        if y3 != y2 + b:
            raise _Unsupported("a size is not on the line through the steps before it")
        if grow and b < 0:
            raise _Unsupported("a size shrinks as the cache grows")
        out.append((y1 - b * x, b))
    return out


def _at(line: list[tuple[int, int]], x: int) -> list[int]:
    return [a + b * x for a, b in line]


class _Line:
    """Three decode steps in a row that did the same things, each size, each slot's shape
    and each of the cache's ints on a line in the cache length, checked by the third."""

    def __init__(self, steps: list[_Step]) -> None:
        s1, s2, s3 = steps
        if (s2.length, s3.length) != (s1.length + 1, s1.length + 2):
            raise _Unsupported("the steps are not one token apart")

        def what(s: _Step) -> tuple:
            # (the slots: the keys of kinds, and of shapes, which holds their tensors' ranks)
            return (s.codes, s.kinds, s.out_type, s.fields, tuple(s.ints),
                    tuple(len(v) for v in s.shapes.values()))

        if not what(s1) == what(s2) == what(s3):
            raise _Unsupported("the steps did different things")
        made = set()
        for kind, slot in s1.codes:
            if kind == "s":
                made.add(slot)
            elif kind == "p" and slot not in made:
                raise _Unsupported("a step frees a cache tensor before it makes the new one")
        x = s1.length
        self.codes, self.kinds = s1.codes, s1.kinds
        self.buffers = sum(kind == "a" for kind, _ in s1.codes)  # transient buffers a step
        self.out_type, self.fields = s1.out_type, s1.fields
        self.sizes = _line(s1.sizes, s2.sizes, s3.sizes, x)
        self.shapes = {slot: _line(s1.shapes[slot], s2.shapes[slot], s3.shapes[slot], x)
                       for slot in s1.shapes}
        paths = list(s1.ints)
        self.ints = dict(zip(paths, _line(*([s.ints[p] for p in paths] for s in steps), x,
                                          grow=False)))
        self.through = (s1.length, s2.length, s3.length)

    def matches(self, step: _Step) -> bool:
        """Whether a step that ran did what the line says at its length."""
        x = step.length
        return (step.codes == self.codes and step.sizes == _at(self.sizes, x)
                and all(list(step.shapes[s]) == _at(v, x) for s, v in self.shapes.items()))


# -- one generate() call's decode steps ------------------------------------------------------------
@atomic
class _Steps:
    """The decode steps of one ``_sample`` call: run until three in a row draw a line, then
    evaluated from it, with a step run as a check after 16 evaluated ones, then after 32,
    64, ... and at ``end`` (the cache length of the last step). A check that does not do
    what the line says, and the step before a cache's sliding window fills, start a new
    line from the steps that follow."""

    def __init__(self, tracker: SimTracker, start: int, end: int) -> None:
        # the cache lengths of the first and the last decode steps
        self.tracker, self.start, self.end = tracker, start, end
        self.ran: list[_Step] = []
        self.calls = 0  # decode steps, run or evaluated
        self.tries = 0  # steps that ran since the last line ended
        self.line: _Line | None = None
        self.until = end  # while a line holds, the steps below this cache length are evaluated
        self.gap = _FIRST_CHECK  # evaluated steps before the next check
        self.stop = end  # the step a line must not pass (the last, or a sliding window's)
        self.reason: str | None = None  # why no step is evaluated (any more)
        self.evaluated: list[int] = []  # cache lengths of the evaluated steps
        self.checks: list[tuple[int, bool]] = []  # (cache length, did what its line says)
        self.bound = 0  # bytes of segments a step of the line could add at most
        self.lines: list[tuple[int, int, int]] = []  # the steps each line went through

    def forward(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("past_key_values")
        ids = next((kwargs[k] for k in _TOKENS if kwargs.get(k) is not None), None)
        if (args or cache is None or not isinstance(ids, torch.Tensor) or ids.dim() < 2
                or ids.shape[1] != 1):
            return original(*args, **kwargs)  # the prefill, or not a step of one token
        # the cache length: counted (a static cache's get_seq_length() reads its values)
        length = self.start + self.calls
        self.calls += 1
        if self.reason is not None:
            return original(**kwargs)
        if self.line is not None and length < self.until:
            out = self._evaluate(cache, length, kwargs)
            if out is not None:
                return out
        return self._run(original, kwargs, cache, length)

    def _run(self, original: Callable, kwargs: dict, cache: Any, length: int) -> Any:
        tracker = self.tracker
        a = tracker.allocator
        start = a.log_length
        before, _ = _serials(tracker, cache)
        given = _inputs(kwargs)
        out = original(**kwargs)
        try:
            after, shapes, kinds, ints, fields = _left(tracker, out, cache, given)
            codes, sizes = _codes(a.log_since(start), before, after)
            self._ran(_Step(length, codes, sizes, shapes, kinds, ints, type(out), fields))
        except _Unsupported as e:
            self.reason = str(e)
        except Exception as e:  # a cache or an output this module does not know: run them all
            self.reason = f"the step could not be read: {type(e).__name__}: {e}"
        return out

    def _ran(self, step: _Step) -> None:
        """A step ran: a check of the line (which then holds to the next one, or ends), or
        one more step to draw a line through."""
        if self.line is not None:
            if self.evaluated and self.evaluated[-1] > self.line.through[-1]:
                ok = self.line.matches(step)
                self.checks.append((step.length, ok))
                if ok and step.length < self.stop:
                    self.gap *= 2
                    self.until = min(step.length + 1 + self.gap, self.stop)
                    return
            # a new line from the next steps, checked as soon as a new one is
            self.line, self.ran, self.tries, self.gap = None, [], 0, _FIRST_CHECK
        self.tries += 1
        if self.ran and self.ran[-1].length != step.length - 1:
            self.ran = []
        self.ran = (self.ran + [step])[-_CHECKED:]
        if len(self.ran) < _CHECKED:
            return
        try:
            self.line = _Line(self.ran)
        except _Unsupported as e:
            if self.tries >= 2 * _CHECKED:
                self.reason = str(e)
            return
        self.lines.append(self.line.through)
        windows = [v for p, v in step.ints.items() if p[-1] == ("a", "sliding_window")]
        # a sliding window's cache keeps its last W - 1 positions: from the step at W - 1
        # on, its tensors are views (which end the reading); the one before runs as a check
        self.stop = min([self.end] + [w - 2 for w in windows if w - 2 > step.length])
        self.until = min(step.length + 1 + self.gap, self.stop)
        top = _at(self.line.sizes, self.stop)
        self.bound = sum(segment_size(round_request(n)) for n in top)

    def _evaluate(self, cache: Any, length: int, kwargs: dict) -> Any:
        """The step at ``length``, evaluated (see the module docstring); None: it must run
        (the line says it runs out of memory)."""
        line, tracker = self.line, self.tracker
        sizes = _at(line.sizes, length)
        if not self._fits(cache, sizes):
            self.reason = f"the line says the step at cache length {length} runs out of memory"
            return None
        # the first step of a line is checked against it: did it do what the line says?
        first = not self.evaluated or self.evaluated[-1] < line.through[-1]
        start = tracker.allocator.log_length
        before = _serials(tracker, cache)[0] if first else {}
        made = self._replay(cache, sizes, length)
        for slot, t in made.items():  # left in the cache where no old tensor was freed
            if slot[0] == "cache":
                _put(cache, slot[1], t)
        for path, ab in line.ints.items():
            _put(cache, path, _at([ab], length)[0])
        out = line.out_type(**{name: _field(f, cache, made, kwargs)
                               for name, f in line.fields.items()})
        tracker.note_cache(cache)  # as after the model's call (no module call ran)
        if first:
            after = _left(tracker, out, cache, _inputs(kwargs))[0]
            codes, got = _codes(tracker.allocator.log_since(start), before, after)
            if (codes, got) != (line.codes, sizes):  # (never seen): say so, run the rest
                self.checks.append((length, False))
                self.reason = "an evaluated step did not do what its line says"
        self.evaluated.append(length)
        return out

    def _replay(self, cache: Any, sizes: list[int], length: int) -> dict[tuple, torch.Tensor]:
        """Do the step's allocs and frees: transient buffers in the allocator model, the
        tensors it leaves as simulated tensors; those tensors, by slot."""
        line, tracker = self.line, self.tracker
        made: dict[tuple, torch.Tensor] = {}
        todo: list[tuple[Any, int | None]] = []
        live: set = set()
        it = iter(sizes)
        keys = _buffers(length, line.buffers)
        try:
            for kind, x in line.codes:
                if kind == "a":
                    todo.append((keys[x], next(it)))
                elif kind == "f":
                    todo.append((keys[x], None))
                else:
                    tracker.replay_transients(todo, live)
                    todo = []
                    if kind == "s":
                        next(it)
                        shape = _at(line.shapes[x], length)
                        dtype, device = line.kinds[x]
                        made[x] = _EMPTY(shape, dtype=dtype, device=device)
                    else:
                        _put(cache, x[1], made.pop(x))
            tracker.replay_transients(todo, live)
        finally:
            if live:  # an interrupt or an error: the step's buffers are freed, as on a GPU
                tracker.replay_transients([(k, None) for k in list(live)], live)
        return made

    def _fits(self, cache: Any, sizes: list[int]) -> bool:
        """Whether the step fits the card (:meth:`CachingAllocatorModel.would_fit`)."""
        def steps():
            slots = {slot: serial for serial, slot in _serials(self.tracker, cache)[0].items()}
            it = iter(sizes)
            for kind, x in self.line.codes:
                if kind in "as":
                    yield (kind, x), next(it)
                else:
                    yield ("a", x) if kind == "f" else slots.get(x), None

        return self.tracker.allocator.would_fit(steps(), self.bound)


# -- the run's generate() calls ------------------------------------------------------------------
def _start(tracker: SimTracker, arguments: dict) -> tuple[_Steps | None, str | None]:
    """The decode steps of a ``_sample`` call with these arguments, or why they all run
    (None, None: too few to read off)."""
    config = arguments.get("generation_config")
    ids = arguments.get("input_ids")
    max_length = getattr(config, "max_length", None)
    if not isinstance(ids, torch.Tensor) or not isinstance(max_length, int):
        return None, None
    last = max_length - 2  # the cache length of the last decode step
    if last - ids.shape[-1] < _CHECKED + 2:
        return None, None
    if arguments.get("synced_gpus"):
        return None, "synced_gpus: every rank steps together"
    other = sorted({type(c).__name__ for c in arguments.get("stopping_criteria") or ()} - _CRITERIA)
    if other:
        return None, f"a stopping criterion reads the tokens ({', '.join(other)})"
    return _Steps(tracker, ids.shape[-1], last), None


class DecodeNotes:
    """The report's one note on the run's ``generate()`` calls: how many decode steps were
    evaluated, from which line, whether the step that ran after them followed it, and why
    a call ran every step."""

    def __init__(self, notes: list) -> None:
        self.notes = notes
        self.at: int | None = None
        self.texts: list[str] = []

    def add(self, steps: _Steps | None, reason: str | None) -> None:
        if steps is not None and steps.evaluated:
            text = _evaluated_text(steps)
        else:
            reason = reason if steps is None else steps.reason
            if reason is None:
                return
            text = f"generate() ran every decode step op by op ({reason})"
        self.texts.append(text)
        shown = "; ".join(self.texts[:3]) + (
            f"; and {len(self.texts) - 3} more generate() calls" if len(self.texts) > 3 else "")
        if self.at is None:
            self.at = len(self.notes)
            self.notes.append(shown)
        else:
            self.notes[self.at] = shown


def _evaluated_text(steps: _Steps) -> str:
    lens = steps.evaluated
    lines = "; ".join(f"{a}, {b} and {c}" for a, b, c in steps.lines)
    text = (f"generate(): {len(lens)} of its {steps.calls} decode steps were evaluated, not run "
            f"(cache lengths {lens[0]}-{lens[-1]}): each one's allocations and frees, sized by "
            "the line through two steps that ran and checked byte for byte by a third (the "
            f"steps at {lines})")
    text += (", done in order on the allocator model, and the cache and logits it leaves made "
             "as simulated tensors; the timeline shows those tensors, not the steps' transient "
             "buffers")
    good = [n for n, ok in steps.checks if ok]
    bad = [n for n, ok in steps.checks if not ok]
    if good:
        many = len(good) > 1
        text += (f"; {len(good)} step{'s' * many} ran op by op as "
                 f"{'checks' if many else 'a check'} (at cache length{'s' * many} "
                 f"{', '.join(map(str, good))}) and did what the line says")
    if bad:
        text += (f"; the check{'s' if len(bad) > 1 else ''} at {', '.join(map(str, bad))} did NOT "
                 "do what the line says: the steps evaluated before, from the last good check, "
                 "may be off (SimBackend(decode='run') runs every step)")
    if steps.reason is not None:
        text += f"; then steps ran op by op ({steps.reason})"
    return text


def decode_targets(tracker: SimTracker, notes: list, read: bool = True) -> tuple:
    """What a simulated run replaces in transformers (as :mod:`.compat`'s targets: module,
    attribute, replacement factory): ``_sample``, whose decode steps are read off, and the
    other decoding methods, which run every step with a note that says so; beam search's
    stopping condition and crop (:data:`_BEAMS_OPEN`), also where no step is read off
    (``read`` False: those only); ``notes``: the report's."""
    said = DecodeNotes(notes)
    steps_left: list[int | None] = []  # each beam search under way: the steps it has left
    beams = f"{_NOT_READ['_beam_search']}: " + ("its steps are not read off; " if read else "")
    targets = ((_MODULE, "GenerationMixin._beam_search",
                _not_read(said, beams + _BEAMS_OPEN, _uncropped, steps_left)),
               (_MODULE, "GenerationMixin._beam_search_has_unfinished_sequences",
                _beams_open(steps_left)))
    if not read:
        return targets
    return ((_MODULE, "GenerationMixin._sample", _sampler(tracker, said)),
            *((_MODULE, f"GenerationMixin.{name}", _not_read(said, f"{mode}: its steps are "
                                                                   "not read off"))
              for name, mode in _NOT_READ.items() if name != "_beam_search"),
            *targets)


def _beams_open(steps_left: list[int | None]) -> Callable[[Any, Any], staticmethod]:
    """A replacement factory for beam search's stopping condition (a staticmethod): its own
    answer where the simulation knows it, else open until the beam search under way
    (``steps_left[-1]``, counted down at each call) has made its last step, as a known
    value (:data:`_BEAMS_OPEN`)."""

    def make(run: Any, original: Any) -> staticmethod:
        condition = original.__func__

        @functools.wraps(condition)
        def has_unfinished(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = condition(*args, **kwargs)
            if (not run.active or not steps_left or steps_left[-1] is None
                    or not _priv.is_fake(out) or _priv.fake_constant(out) is not None):
                return out
            steps_left[-1] -= 1
            return torch.full_like(out, steps_left[-1] > 0)
        return staticmethod(has_unfinished)
    return make


def _beam_steps(arguments: dict) -> int | None:
    """The steps a beam search of ``arguments`` (``_beam_search``'s) makes where no beam
    ends before the maximum length (None: unknown)."""
    length = getattr(arguments.get("generation_config"), "max_length", None)
    ids = arguments.get("input_ids")
    if not isinstance(length, int) or not isinstance(ids, torch.Tensor):
        return None
    return length - ids.shape[-1]


def _uncropped(out: Any, arguments: dict) -> Any:
    """Beam search's output, its sequences (and beams' indices) ``max_length`` long: beam
    search crops them to the longest it generated, read off the beams' indices (values a
    simulation has not: its placeholder, 0, cropped them to nothing); with every beam open
    to the maximum length (:func:`_beams_open`) that is all of them, the crop a view of the
    whole (:data:`_BEAMS_OPEN`)."""
    config = arguments.get("generation_config")
    length = getattr(config, "max_length", None)
    if not isinstance(length, int):
        return out
    prompt = arguments.get("input_ids")
    prompt = prompt.shape[-1] if isinstance(prompt, torch.Tensor) else 0
    if isinstance(out, torch.Tensor):
        return _whole_rows(out, length)
    for name, width in (("sequences", length), ("beam_indices", length - prompt)):
        t = getattr(out, name, None)
        if isinstance(t, torch.Tensor):
            out[name] = _whole_rows(t, width)
    return out


def _whole_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` (rows cropped from a tensor ``width`` wide) as the whole rows: a view over its
    storage (``t`` where it is as wide, or its storage holds less)."""
    if t.dim() != 2 or t.shape[1] >= width or t.stride(1) != 1 or t.stride(0) < width:
        return t
    end = t.storage_offset() + (t.shape[0] - 1) * t.stride(0) + width
    if t.untyped_storage().nbytes() < end * t.element_size():
        return t
    return t.as_strided((t.shape[0], width), t.stride(), t.storage_offset())


def _not_read(notes: DecodeNotes, mode: str, fix: Callable | None = None,
              steps_left: list[int | None] | None = None
              ) -> Callable[[Any, Callable], Callable]:
    """A replacement factory for a decoding method whose steps all run: the note ``mode``;
    ``fix(output, arguments)``: what the simulation makes of its output; with
    ``steps_left``, beam search's steps (:func:`_beam_steps`) are on it while it runs."""
    def make(run: Any, original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def method(self, *args: Any, **kwargs: Any) -> Any:
            try:
                arguments = signature.bind(self, *args, **kwargs).arguments
            except TypeError:  # another transformers' signature: nothing read off it
                arguments = {}
            counted = run.active and steps_left is not None
            if counted:
                steps_left.append(_beam_steps(arguments))
            try:
                out = original(self, *args, **kwargs)
                return fix(out, arguments) if fix is not None and run.active else out
            finally:
                if counted:
                    steps_left.pop()
                if run.active:
                    notes.add(None, mode)
        return method
    return make


def _sampler(tracker: SimTracker, notes: DecodeNotes) -> Callable[[Any, Callable], Callable]:
    """A replacement factory for ``GenerationMixin._sample`` (the form of
    :mod:`.compat`'s targets): each call's decode steps as this module reads them off."""

    def make(run: Any, original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def _sample(self, *args: Any, **kwargs: Any) -> Any:
            a = tracker.allocator
            if not run.active or a is None or not a.logging:
                return original(self, *args, **kwargs)
            try:
                arguments = signature.bind(self, *args, **kwargs).arguments
            except TypeError:
                return original(self, *args, **kwargs)
            steps, reason = _start(tracker, arguments)
            if steps is None:
                notes.add(None, reason)
                return original(self, *args, **kwargs)
            # the decode steps call self.__call__, taken once (the prefill calls the model):
            # an evaluated step runs no module call, so no module hook counts it as a pass
            patches = Patches()
            patches.set(self, "__call__", functools.partial(steps.forward, self.__call__))
            try:
                return original(self, *args, **kwargs)
            finally:
                patches.restore()
                notes.add(steps, None)
        return _sample
    return make
