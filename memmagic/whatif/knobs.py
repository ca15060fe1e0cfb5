"""What-if knobs: the table of the settings a cell can be re-run under, and :class:`Setting`.

A :class:`Knob` is data: its name (the plain variable a cell reads to handle the knob
itself, see :mod:`memmagic.whatif.engine`), its values, its default (the cell as written),
how memmagic applies it to a cell that does not read the variable, and what each consumer
makes of it, one group of fields each: the magic's option (:class:`Option`), the what-if
panel's control (:class:`Control`), the memory doctor's fixes (:class:`Doctor`), the sizes
of the data the engine sets itself (:class:`Sizes`: the dimension a knob resizes, or the
accumulation that splits the batch) and the backend option the engine sets for it
(:class:`BackendOption`: the target card). A :class:`Setting` is one choice of values.
Adding a knob is one entry in :data:`KNOBS` (and, when memmagic can apply it, one small
``apply`` function over an :class:`~memmagic.whatif.apply.Applier` in
:mod:`memmagic.whatif.apply`). Code elsewhere finds a knob by what its entry says
(:func:`resizing`, :func:`accumulating`, :func:`panel_sweep`, :func:`for_backend_option`,
:func:`targeting`), never by its name.

Knobs and how memmagic applies them where the cell does not read the variable:

================  ============================  =================================================
knob (variable)   values                        applied by memmagic as
================  ============================  =================================================
``amp``           off / fp16 / bf16             autocast from each outermost module call until
                                                the backward (the forward and the loss); fp16
                                                adds a GradScaler (scale, unscale_, update)
``batch_size``    int (effective batch)         tensors of the namespace the cell names whose
                                                first dimension is the batch, resized
``seq_len``       int (tokens per sample)       the token tensors of the namespace the cell
                                                names (integer or bool, [batch, seq, ...]: input
                                                ids, masks, labels) cut or repeated along dim 1
``new_tokens``    int (``max_new_tokens``)      each ``generate()`` call's ``max_new_tokens`` (a
                                                transformers model's)
``accum_steps``   int                           the cell repeated per micro-step on
                                                batch_size / accum_steps, optimizer steps held
                                                back and gradients kept until the last one
``checkpointing`` on / off                      the repeated blocks of each model (children of a
                                                ModuleList / Sequential, or a named module type)
                                                run through torch.utils.checkpoint
``weights_dtype`` fp32 / bf16 / fp16            each model the cell names converted
                                                (``model.to(bfloat16)``) before the measurement, as
                                                if loaded so (put back after the run); a model the
                                                cell makes, at its first call; inputs cast to match
``grad_mode``     train / no_grad /             the cell under torch.no_grad() or
                  inference_mode                torch.inference_mode(), models in eval(), its
                                                backward() calls and optimizer steps skipped
``offload``       on / off                      torch.autograd.graph.save_on_cpu around the cell
``optimizer``     sgd / sgd-momentum / adam /   the optimizer the cell builds (any torch.optim
                  adamw / adafactor             class) replaced by this one, same parameters
``inplace``       on / off                      ``inplace=True`` on activation and dropout
                                                modules that have the flag
``gpu``           a card of the simulated       the simulated backend's target: fits or not
                  device's table
================  ============================  =================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from .apply import (OPTIMIZERS, KnobError, apply_amp, apply_checkpointing, apply_grad_mode,
                    apply_inplace, apply_new_tokens, apply_offload, apply_optimizer,
                    apply_weights, torch_dtype)

if TYPE_CHECKING:
    from .apply import Applier

__all__ = ["Knob", "KNOBS", "NEEDS", "Fixes", "Setting", "KnobError", "Option", "Control",
           "Doctor", "Sizes", "BackendOption", "BATCH_DIM", "SEQ_DIM", "resizing",
           "accumulating", "panel_sweep", "for_backend_option", "targeting", "AMP_CHOICES",
           "WEIGHT_DTYPES", "GRAD_MODES", "OPTIMIZERS", "knob_value", "setting_of"]

AMP_CHOICES = ("off", "fp16", "bf16")
WEIGHT_DTYPES = ("fp32", "bf16", "fp16")
GRAD_MODES = ("train", "no_grad", "inference_mode")
BATCH_DIM, SEQ_DIM = 0, 1  # the dimensions the sizing knobs resize: the batch's, the tokens'
_AS_WRITTEN = "as written"


# -- the knobs --------------------------------------------------------------------------
# What a run of the cell must show for memmagic to apply a knob (``Knob.needs``), judged
# from what the run did (:class:`memmagic.whatif.engine.RunInfo`).
NEEDS: dict[str, Callable[[Any], bool]] = {
    "model": lambda info: bool(info.models),                  # a module was called
    # a model whose weights are floating point (a 4-bit or 8-bit model keeps its own)
    "float_weights": lambda info: bool(info.models) and not info.quantized,
    "batch": lambda info: info.batch_known,                   # a batch size to start from
    "seq": lambda info: info.seq_known,                       # a sequence length to start from
    "generate": lambda info: info.generate_calls > 0,         # a transformers generate() ran
    "accum": lambda info: info.batch_known and info.backward_calls > 0 and not info.built,
    "blocks": lambda info: info.blocks > 0,                   # repeated blocks to wrap
    "backward": lambda info: info.backward_calls > 0,
    "optimizer": lambda info: bool(info.optimizers_built),    # the cell builds one
    "inplace": lambda info: info.inplace_modules > 0,
    "sim": lambda info: info.sim,                             # the simulated backend
}


@dataclass(frozen=True)
class Fixes:
    """What the memory doctor knows of the cell when it proposes fixes: the batch size and
    the sequence length as written (None: unknown) and the optimizer the cell builds
    (lower-case class name)."""

    batch: int | None = None
    optimizer: str | None = None
    seq: int | None = None


Fix = tuple[str, dict[str, Any]]  # a doctor's candidate: (label, {knob: value})


@dataclass(frozen=True)
class Option:
    """The magic's ``--flag`` option of a knob (``Knob.option``; None: the knob has none)."""

    help: str
    metavar: str | None = None
    # the option's text to (value, options for the cell) where it says more than a value
    # (``--checkpointing MODULE``); its errors name the option
    parse: Callable[[str], tuple[Any, dict[str, Any]]] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Control:
    """The what-if panel's control of a knob (``Knob.panel``; None: no control).

    ``widget`` is "slider", "buttons", "menu" or "checkbox"; ``range`` an integer
    control's (lo, hi), widened to the cell's own value with ``grow``; ``unset_label``
    names the default None in a menu; ``sweep``: the panel's sweep button runs this knob
    across the control's values ("largest that fits", see :func:`panel_sweep`)."""

    widget: str
    range: tuple[int, int] | None = None
    grow: bool = False
    unset_label: str = _AS_WRITTEN
    sweep: bool = False


@dataclass(frozen=True)
class Doctor:
    """What the memory doctor does with a knob (``Knob.doctor``).

    ``fixes(Fixes)`` gives its candidate fixes as (label, {knob: value}); when no single
    fix fits, a combination takes at most one fix per ``family`` (default: the knob's
    own name; the batch size and its accumulation are one family) and none of this knob
    after a fix of a family in ``excluded_by``; ``untried`` is the note when the knob does
    not apply to what ran (why none of its fixes was tried), by what ran: "cell" (the
    magic), "script" (the command line). ``from_first_step``: the knob changes nothing
    before the first optimizer step begins (an optimizer makes its state there), so its
    fixes are not re-run for a run that ran out of memory before one began: they would
    run out at the same place. ``already(info, value)``: the run (its
    :class:`~memmagic.whatif.engine.RunInfo`) does what the fix would, by the cell's own
    code, so the fix is not re-run (the words say how, or None: it does not)."""

    fixes: Callable[[Fixes], list[Fix]] | None = field(default=None, repr=False)
    family: str | None = None
    excluded_by: tuple[str, ...] = ()
    untried: Mapping[str, str] | None = None
    from_first_step: bool = False
    already: Callable[[Any, Any], str | None] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Sizes:
    """A knob that sizes the data one run of the cell sees (``Knob.sizes``): the engine
    applies it itself, not an ``apply`` function.

    ``resize``: the dimension of the namespace's tensors the cell names that it resizes
    (:data:`BATCH_DIM`: every tensor's first, the batch; :data:`SEQ_DIM`: the token
    tensors' second, the sequence); ``splits_batch``: its value is the number of
    micro-steps the batch is split into (gradient accumulation: the cell repeated per
    micro-step); ``noun`` the size in words ("64 is the largest batch"); ``missing`` the
    error when there is nothing to size (no tensor to resize, no batch to split). A script
    run by ``python -m memmagic run`` takes such a knob only on its own command line
    (:attr:`Knob.script_flags`): a fresh ``__main__`` holds no batch to resize, and a
    whole script is not repeated per micro-step. ``script_dests``: argparse destinations
    other than the knob's variable that carry its value in a script, in the order one is
    preferred where a script has several (the batch one device takes in one step before
    a global one: transformers' ``per_device_train_batch_size``, which
    ``HfArgumentParser`` makes of ``TrainingArguments``, nanochat's ``--device-batch-size``),
    and which are also its names as a call's keyword or a settings dict's key;
    ``option_dests``: destinations that carry it only as a script's option (``--block_size``
    sizes nanoGPT's data, where ``GPTConfig(block_size=...)`` in a cell sizes only a model).
    """

    resize: int | None = None
    splits_batch: bool = False
    noun: str = ""
    missing: str = ""
    script_dests: tuple[str, ...] = ()
    option_dests: tuple[str, ...] = ()


@dataclass(frozen=True)
class BackendOption:
    """A knob the engine applies by a backend option (``Knob.backend``): the target card.

    ``option`` is the option it sets (the simulated backend's ``gpu=``), on ``backend``
    only (``elsewhere``: the error on another); ``replaces`` the options it takes the
    place of (a card's size, ``gpu_memory=``)."""

    option: str
    backend: str
    replaces: tuple[str, ...] = ()
    elsewhere: str = ""


@dataclass(frozen=True)
class Knob:
    """One what-if knob: everything memmagic does with it comes from this entry.

    ``name`` is both the :class:`Setting` field and the variable a cell reads to handle
    the knob itself (``variable`` when they differ); ``default`` is the baseline (the cell
    as written; None means "whatever the cell does"). ``kind`` is "choice", "int" or
    "bool"; ``choices`` the allowed values of a choice (None allowed as the default), or
    ``choices_from()`` where they are read when asked (the simulated device's cards), with
    ``normalise(value)`` checking one where the choices' spelling is not enough;
    ``low``/``high`` an int's range. ``how`` says in words how memmagic applies it where
    the cell does not read the variable; ``apply(applier, value)`` does it (None: the
    engine itself applies it, as ``sizes`` or ``backend`` say). ``cell_value`` maps a
    setting's value to what the cell's variable holds (``amp="fp16"`` -> ``torch.float16``).
    ``needs`` names what a run must show for memmagic to apply it (a key of :data:`NEEDS`).

    The consumers read the rest: ``option`` makes the magic's ``--flag`` (None: no
    option); ``short`` names a set value in a setting's label; ``panel`` is the what-if
    control (None: none); ``doctor`` says what the memory doctor tries; ``strategy``
    (label off, label on, value) makes it an axis of a sweep's default strategies.
    """

    name: str
    label: str
    kind: str
    default: Any
    how: str
    # its values
    choices: tuple = ()
    choices_from: Callable[[], tuple] | None = field(default=None, repr=False)
    normalise: Callable[[Any], Any] | None = field(default=None, repr=False)
    low: int | None = None
    high: int | None = None
    # how memmagic applies it
    apply: Callable[["Applier", Any], None] | None = field(default=None, repr=False)
    cell_value: Callable[[Any], Any] | None = field(default=None, repr=False)
    variable: str | None = None
    needs: str = "model"
    sizes: Sizes | None = None
    backend: BackendOption | None = None
    # what the front ends, the doctor and the sweeps make of it
    option: Option | None = None
    short: str = ""
    panel: Control | None = None
    doctor: Doctor = Doctor()
    strategy: tuple[str, str, Any] | None = None

    @property
    def var(self) -> str:
        """The variable a cell reads to handle this knob itself."""
        return self.variable or self.name

    @property
    def flag(self) -> str:
        """The magic's option: ``--batch-size`` for ``batch_size``."""
        return "--" + self.name.replace("_", "-")

    @property
    def resize(self) -> int | None:
        """The dimension of the cell's tensors this knob resizes (None: none)."""
        return self.sizes.resize if self.sizes is not None else None

    @property
    def family(self) -> str:
        """The doctor's family of this knob's fixes (one per combination)."""
        return self.doctor.family or self.name

    @property
    def script_flags(self) -> tuple[str, ...]:
        """A script's own options that carry this knob's value (argparse's dest is the
        knob's variable): ``--batch_size`` and ``--batch-size``; none but for the knobs
        that size the data (see :class:`Sizes`)."""
        if self.sizes is None:
            return ()
        return "--" + self.var, "--" + self.var.replace("_", "-")

    @property
    def script_dests(self) -> tuple[str, ...]:
        """The argparse destinations that carry this knob's value in a script (its
        variable, and :attr:`Sizes.script_dests`); none but for the knobs that size the
        data."""
        if self.sizes is None:
            return ()
        dests = self.sizes.script_dests
        return dests if self.var in dests else (self.var, *dests)

    @property
    def option_dests(self) -> tuple[str, ...]:
        """The argparse destinations of a script's options that carry this knob's value
        (:attr:`script_dests` and :attr:`Sizes.option_dests`)."""
        if self.sizes is None:
            return ()
        return (*self.script_dests, *self.sizes.option_dests)

    def applies(self, info: Any) -> bool:
        """Whether memmagic can apply this knob to a run that did what ``info`` says."""
        return NEEDS[self.needs](info)

    def values(self) -> tuple:
        """The values a menu offers (``choices_from()`` where they are read when asked)."""
        return self.choices_from() if self.choices_from is not None else self.choices

    def argument(self) -> tuple[tuple[str, ...], dict[str, Any]]:
        """(flags, keyword arguments) of the magic's option for this knob."""
        text, metavar, parse = (self.option.help, self.option.metavar, self.option.parse) \
            if self.option is not None else (None, None, None)
        kwargs: dict[str, Any] = dict(default=None, help=text)
        if parse is not None:
            kwargs.update(nargs="?", const="on", metavar=metavar)
        elif self.kind == "bool":
            kwargs.update(action="store_true")
        else:
            kwargs.update(metavar=metavar or self.name.upper())
        return (self.flag,), kwargs

    def from_option(self, text: Any) -> tuple[Any, dict[str, Any]]:
        """The magic option's text as (value, options for the cell); KnobError names the
        option."""
        parse = self.option.parse if self.option is not None else None
        if parse is not None and isinstance(text, str):
            return parse(text)  # its errors name the option
        try:
            return self.check(text), {}
        except KnobError as exc:
            raise KnobError(f"{self.flag}: {exc}") from None

    def span(self, value: int | None) -> tuple[int, int]:
        """An integer control's range for a cell whose own value is ``value``."""
        panel = self.panel or Control("")
        lo, hi = panel.range or (self.low or 1, self.high or 1)
        if panel.grow and value is not None:
            lo, hi = min(lo, value), max(hi, 4 * value)
        return lo, hi

    def check(self, value: Any) -> Any:
        """``value`` validated (and normalised: "on" -> True, "32" -> 32) for this knob."""
        if value is None and self.default is None:
            return None
        if self.kind == "bool":
            if isinstance(value, str) and value.lower() in ("on", "true", "1", "yes"):
                return True
            if isinstance(value, str) and value.lower() in ("off", "false", "0", "no"):
                return False
            if isinstance(value, bool):
                return value
            raise KnobError(f"{self.name} is on or off (True/False), not {value!r}")
        if self.kind == "int":
            try:
                n = int(value)
            except (TypeError, ValueError):
                n = None
            if n is None or isinstance(value, bool) or (isinstance(value, float) and n != value):
                raise KnobError(f"{self.name} needs a whole number, not {value!r}")
            if (self.low is not None and n < self.low) or (self.high is not None and n > self.high):
                raise KnobError(f"{self.name} must be between {self.low} and {self.high}, not {n}")
            return n
        v = value.lower() if isinstance(value, str) else value
        if self.normalise is not None:
            return self.normalise(value)
        if v not in self.choices:
            raise KnobError(f"{self.name} must be one of {', '.join(map(str, self.choices))}, "
                            f"not {value!r}")
        return v

    def show(self, value: Any) -> str:
        """The value in words, for labels."""
        if value is None:
            return _AS_WRITTEN
        if self.kind == "bool":
            return "on" if value else "off"
        return str(value)


def _check_gpu(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value.lower() in ("", "none")):
        return None
    from ..backends.sim import GPUS, resolve_target

    try:  # the card's name, or another of its names ("H100", as --gpu takes)
        return resolve_target(str(value)).name
    except ValueError:
        raise KnobError(f"gpu must be one of {', '.join(g.name for g in GPUS.values())}, "
                        f"not {value!r}") from None


def _gpu_names() -> tuple[str, ...]:
    try:
        from ..backends.sim import GPUS
    except ImportError:  # pragma: no cover
        return ()
    return tuple(g.name for g in GPUS.values())



# -- the entries' functions -------------------------------------------------------------------
def _batch_fixes(f: Fixes) -> list[tuple[str, dict[str, Any]]]:
    b = f.batch
    return [(f"batch {b // d} (from {b})", {"batch_size": b // d})
            for d in (2, 4) if b and b // d >= 1 and b // d != b]


def _seq_fixes(f: Fixes) -> list[tuple[str, dict[str, Any]]]:
    s = f.seq
    return [(f"context {s // d} (from {s})", {"seq_len": s // d})
            for d in (2, 4) if s and s // d >= 1 and s // d != s]


def _accum_fixes(f: Fixes) -> list[tuple[str, dict[str, Any]]]:
    b = f.batch
    return [(f"accumulate {n} x {b // n} (batch {b})", {"accum_steps": n})
            for n in (2, 4) if b and b % n == 0 and b // n >= 1]


def _optimizer_fixes(f: Fixes) -> list[tuple[str, dict[str, Any]]]:
    return [(f"optimizer: {label}", {"optimizer": name})
            for name, label in (("sgd-momentum", "SGD with momentum (1 state)"),
                                ("adafactor", "Adafactor (factored state)"))
            if name != f.optimizer]


def _amp_already(info: Any, value: str) -> str | None:
    """Every model call ran under the cell's own autocast of ``value``'s dtype."""
    if value == "off" or info.autocast_at_calls != {(True, torch_dtype(value))}:
        return None
    return f"runs every model call under autocast {value} already"


_OPTION_ON = ("on", "true", "yes", "1")
_OPTION_OFF = ("off", "false", "no", "0")


def _checkpointing_option(text: str) -> tuple[bool, dict[str, Any]]:
    """``--checkpointing`` [on|off|MODULE]: a module class name wraps the modules of that
    class instead of the repeated blocks."""
    low = text.lower()
    if low in _OPTION_ON + _OPTION_OFF:
        return low in _OPTION_ON, {}
    if text.isidentifier():
        return True, {"checkpoint_module": text}
    raise KnobError(f"--checkpointing takes on, off or a module class name (TransformerBlock), "
                    f"not {text!r}")


# why the doctor tried no smaller batch, and how to let it try them
BATCH_HINT = ("no smaller batch was tried: the cell makes its batch with a fixed size. Write "
              "the size as a variable (batch_size = 4096, once, at the top of this cell or "
              "in an earlier one, then torch.randn(batch_size, ...)), pass it by name "
              "(DataLoader(ds, batch_size=4096), or to a function of yours whose parameter "
              "is batch_size), or make the batch in an earlier cell, and the doctor re-runs "
              "the cell with smaller batches")
SCRIPT_BATCH_HINT = ("no smaller batch was tried: the script does not take its batch size on "
                     "its command line. Pass it one (--batch_size N or --batch_size=N, or "
                     "--batch-size, --device-batch-size, a config's --trainer.batch_size=N; a "
                     "script without such an option needs one, e.g. argparse's "
                     "add_argument('--batch_size', type=int)), or set it as a number at the "
                     "script's top level (batch_size = 64, or one settings dict's entry: "
                     "{\"batch_size\": 64}, or a call's: DataLoader(ds, batch_size=64)), and "
                     "the doctor re-runs it with smaller batches")

_NO_BATCH = ("batch_size: the cell does not read batch_size and names no batch tensor of the "
             "namespace: make the batch with batch_size in the cell (e.g. "
             "x = torch.randn(batch_size, ...))")
# a script's names for the batch (argparse destinations, keywords, settings keys), the
# batch one device takes in one step first (Sizes.script_dests): transformers' and
# DeepSpeed's, nanochat's --device-batch-size, Megatron's and lit-gpt's --micro-batch-size
_BATCH_DESTS = ("per_device_train_batch_size", "device_batch_size", "micro_batch_size",
                "train_micro_batch_size_per_gpu", "per_gpu_train_batch_size",
                "batch_size_per_gpu", "batch_size_per_device", "per_device_batch_size",
                "batch_size", "train_batch_size", "mini_batch_size", "batch", "bs")
# a script's options for the context (Sizes.option_dests): nanoGPT's --block_size,
# llm.c's --sequence_length, nanochat's --max-seq-len, trl's and peft's --max_seq_length
_SEQ_OPTION_DESTS = ("max_seq_len", "max_seq_length", "seq_length", "sequence_length",
                     "sequence_len", "context_length", "ctx_len", "block_size", "seq")
_NO_TOKENS = ("seq_len: the cell does not read seq_len and names no token tensor of the "
              "namespace (integer ids or a mask of shape [batch, seq]): make the inputs with "
              "seq_len in the cell (e.g. torch.randint(0, vocab, (batch_size, seq_len)))")
_NO_BATCH_TO_SPLIT = ("accum_steps splits a batch: the cell needs a batch size (read "
                      "batch_size in the cell, or pass one with --batch-size)")


KNOBS: dict[str, Knob] = {k.name: k for k in [
    Knob("amp", "AMP", "choice", "off", "autocast from each model call until its backward; "
         "fp16 with a GradScaler", choices=AMP_CHOICES, apply=apply_amp, cell_value=torch_dtype,
         needs="model", short="amp", panel=Control("buttons"),
         option=Option("What-if knob: autocast around each model call and its loss (fp16 with "
                       "a GradScaler), unless the cell reads the variable amp itself.",
                       metavar="{off,fp16,bf16}"),
         doctor=Doctor(lambda f: [("AMP fp16", {"amp": "fp16"}), ("AMP bf16", {"amp": "bf16"})],
                       excluded_by=("weights_dtype",), already=_amp_already),
         strategy=("fp32", "amp bf16", "bf16")),
    Knob("batch_size", "batch size", "int", None, "the namespace's batch tensors the cell "
         "names, resized along their first dimension", low=1, high=1 << 20, needs="batch",
         sizes=Sizes(resize=BATCH_DIM, noun="batch", missing=_NO_BATCH,
                     script_dests=_BATCH_DESTS),
         panel=Control("slider", range=(1, 512), grow=True, sweep=True),
         option=Option("What-if knob: the (effective) batch size; the cell reads batch_size, "
                       "or memmagic resizes the batch tensors of the namespace the cell names.",
                       metavar="N"),
         doctor=Doctor(_batch_fixes, family="batch",
                       untried={"cell": BATCH_HINT, "script": SCRIPT_BATCH_HINT})),
    Knob("seq_len", "sequence length", "int", None, "the namespace's token tensors the cell "
         "names (integer or bool [batch, seq, ...]: ids, masks, labels), cut or repeated along "
         "their second dimension", low=1, high=1 << 20, needs="seq", short="seq",
         sizes=Sizes(resize=SEQ_DIM, noun="sequence length", missing=_NO_TOKENS,
                     option_dests=_SEQ_OPTION_DESTS),
         panel=Control("slider", range=(16, 2048), grow=True),
         option=Option("What-if knob: the sequence length (tokens per sample); the cell reads "
                       "seq_len, or memmagic cuts or repeats the token tensors of the namespace "
                       "the cell names.", metavar="T"),
         doctor=Doctor(_seq_fixes)),
    Knob("new_tokens", "new tokens", "int", None, "each generate() call's max_new_tokens",
         low=1, high=1 << 17, apply=apply_new_tokens, variable="max_new_tokens",
         needs="generate", short="new tokens",
         panel=Control("slider", range=(1, 1024), grow=True),
         option=Option("What-if knob: the new tokens each generate() call makes "
                       "(max_new_tokens); the cell reads max_new_tokens, or memmagic sets it "
                       "on each call.", metavar="N")),
    Knob("accum_steps", "accumulation steps", "int", 1, "the cell repeated per micro-step on "
         "batch_size / accum_steps, optimizer steps held back until the last", low=1, high=1024,
         needs="accum", sizes=Sizes(splits_batch=True, missing=_NO_BATCH_TO_SPLIT),
         panel=Control("buttons", range=(1, 16)),
         option=Option("What-if knob: gradient accumulation over K micro-batches of "
                       "batch_size / K (the cell reads accum_steps, or memmagic repeats it per "
                       "micro-step with the optimizer step held back).", metavar="K"),
         doctor=Doctor(_accum_fixes, family="batch")),
    Knob("checkpointing", "checkpointing", "bool", False, "the models' repeated blocks run "
         "through torch.utils.checkpoint", apply=apply_checkpointing, needs="blocks",
         short="ckpt", panel=Control("checkbox"),
         option=Option("What-if knob: activation checkpointing of the model's repeated blocks "
                       "(children of a ModuleList/Sequential), or of the modules of class MODULE.",
                       metavar="MODULE", parse=_checkpointing_option),
         doctor=Doctor(lambda f: [("activation checkpointing", {"checkpointing": True})]),
         strategy=("", "ckpt", True)),
    Knob("weights_dtype", "weights dtype", "choice", None, "each model converted before the "
         "measurement, as if loaded in that dtype (.to(bfloat16) / .half())",
         choices=WEIGHT_DTYPES, apply=apply_weights, cell_value=torch_dtype,
         needs="float_weights",
         short="weights", panel=Control("buttons"),
         option=Option("What-if knob: convert the model's weights (model.half()).",
                       metavar="{fp32,bf16,fp16}"),
         doctor=Doctor(lambda f: [("bf16 weights", {"weights_dtype": "bf16"}),
                                  ("fp16 weights", {"weights_dtype": "fp16"})])),
    Knob("grad_mode", "mode", "choice", "train", "the cell under no_grad / inference_mode, "
         "models in eval(), backward and steps skipped", choices=GRAD_MODES,
         apply=apply_grad_mode, needs="backward", panel=Control("buttons"),
         option=Option("What-if knob: a training step, or a forward under no_grad / "
                       "inference_mode.", metavar="{train,no_grad,inference_mode}")),
    Knob("offload", "offload activations", "bool", False, "save_on_cpu around the cell",
         apply=apply_offload, needs="backward", short="offload", panel=Control("checkbox"),
         option=Option("What-if knob: keep tensors saved for backward on the CPU (save_on_cpu)."),
         doctor=Doctor(lambda f: [("offload saved activations to CPU", {"offload": True})])),
    Knob("optimizer", "optimizer", "choice", None, "the optimizer the cell builds replaced",
         choices=OPTIMIZERS, apply=apply_optimizer, variable="optimizer_name",
         needs="optimizer", panel=Control("menu", unset_label="as in the cell"),
         option=Option("What-if knob: replace the optimizer the cell builds.",
                       metavar="{sgd,sgd-momentum,adam,adamw,adafactor}"),
         doctor=Doctor(_optimizer_fixes, from_first_step=True)),
    Knob("inplace", "in-place activations", "bool", False, "inplace=True on activation and "
         "dropout modules", apply=apply_inplace, needs="inplace", short="inplace",
         panel=Control("checkbox"),
         option=Option("What-if knob: inplace=True on activation and dropout modules.")),
    Knob("gpu", "target GPU", "choice", None, "the simulated card: fits or not",
         choices_from=_gpu_names, normalise=_check_gpu, variable="gpu_name", needs="sim",
         short="on", panel=Control("menu", unset_label="no card"),
         backend=BackendOption("gpu", "sim", replaces=("gpu_memory",),
                               elsewhere="gpu picks the simulated card: it needs the sim backend")),
]}


# -- finding a knob by what its entry says -------------------------------------------------------
def resizing(dim: int) -> Knob:
    """The knob that resizes the cell's tensors along ``dim`` (:data:`BATCH_DIM`: the batch
    size; :data:`SEQ_DIM`: the sequence length)."""
    return _the(lambda k: k.resize == dim, f"resizes dimension {dim}")


def accumulating() -> Knob:
    """The knob that splits the batch into micro-steps (gradient accumulation)."""
    return _the(lambda k: k.sizes is not None and k.sizes.splits_batch, "splits the batch")


def panel_sweep() -> Knob | None:
    """The knob the what-if panel's sweep button runs across its control's values (None:
    no sweep)."""
    return next((k for k in KNOBS.values() if k.panel is not None and k.panel.sweep), None)


def for_backend_option(option: str) -> Knob | None:
    """The knob the engine applies by the backend option ``option`` (the simulated
    backend's ``gpu``: the target card), or None."""
    return next((k for k in KNOBS.values() if k.backend is not None and k.backend.option == option),
                None)


def targeting() -> Knob:
    """The knob of the target card: the one the engine applies by a backend option."""
    return _the(lambda k: k.backend is not None, "sets the target card")


def _the(test: Callable[[Knob], bool], what: str) -> Knob:
    for knob in KNOBS.values():
        if test(knob):
            return knob
    raise LookupError(f"no knob of memmagic.KNOBS {what}")


# a setting's values that mean "off" to a cell whose variable is a flag (amp = False)
_OFF_VALUES = (None, False, 0, "off", "fp32", "train")


def knob_value(name: str, value: Any, like: Any = None) -> Any:
    """What a cell's variable for knob ``name`` holds when the setting is ``value``.

    ``like`` is the variable's own value in the namespace, whose type the knob's value
    takes: a flag (``amp = False``, for ``autocast(enabled=amp)``) gets True or False, a
    name (``amp = "bf16"``) the setting's name, a dtype the dtype; otherwise the knob's
    own form (``amp="fp16"`` -> ``torch.float16``). A setting left "as written" (None)
    keeps the cell's own value."""
    knob = KNOBS[name]
    if value is None and like is not None:
        return like
    if isinstance(like, bool):
        return value not in _OFF_VALUES
    if isinstance(like, str) and isinstance(value, str):
        return value
    return knob.cell_value(value) if knob.cell_value is not None else value


def setting_of(name: str, own: Any) -> Any:
    """The knob setting that a cell's own variable ``own`` stands for (the inverse of
    :func:`knob_value`): ``amp = False`` is "off", ``amp = True`` the first of its
    choices that is on, a dtype its name; None when it says nothing the knob knows."""
    knob = KNOBS[name]
    if knob.kind == "bool" or knob.kind == "int":
        try:
            return knob.check(own)
        except KnobError:
            return None
    if isinstance(own, bool):
        if not own:
            return knob.default if knob.default in _OFF_VALUES else None
        return next((c for c in knob.choices if c not in _OFF_VALUES), None)
    names = {str(torch_dtype(c)): c for c in knob.choices if c in ("fp32", "fp16", "bf16")}
    if str(own) in names:
        return names[str(own)]
    try:
        return knob.check(own)
    except (KnobError, TypeError):
        return None


# -- settings ------------------------------------------------------------------------------
class Setting:
    """One choice of knob values; unset knobs are at their default (the cell as written).

    Immutable and hashable: ``Setting(amp="fp16", batch_size=64)``,
    ``s.replace(accum_steps=4)``, ``s.amp``. ``batch_size`` is the effective batch (samples
    per optimizer step, :attr:`effective_batch`); :attr:`micro_batch` is what one forward
    sees, one of :attr:`micro_steps`."""

    __slots__ = ("_items",)

    def __init__(self, **values: Any) -> None:
        items = {}
        for name, value in values.items():
            knob = KNOBS.get(name)
            if knob is None:
                raise TypeError(f"unknown knob {name!r}; knobs: {', '.join(KNOBS)}")
            v = knob.check(value)
            if v != knob.default or (v is None) != (knob.default is None):
                items[name] = v
        object.__setattr__(self, "_items", tuple((k, items[k]) for k in KNOBS if k in items))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        knob = KNOBS.get(name)
        if knob is None:
            raise AttributeError(f"no knob {name!r}; knobs: {', '.join(KNOBS)}")
        return dict(object.__getattribute__(self, "_items")).get(name, knob.default)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a Setting is immutable: use setting.replace(...)")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Setting) and self._items == other._items

    def __hash__(self) -> int:
        return hash(self._items)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        """(knob, value) for the knobs set away from their default."""
        return iter(self._items)

    def changed(self) -> dict[str, Any]:
        return dict(self._items)

    def replace(self, **values: Any) -> "Setting":
        merged = dict(self._items)
        merged.update(values)
        return Setting(**merged)

    @property
    def effective_batch(self) -> int | None:
        """The samples per optimizer step: the batch size (None: as written)."""
        return getattr(self, resizing(BATCH_DIM).name)

    @property
    def micro_steps(self) -> int:
        """The micro-steps the batch is split into: the accumulation steps (1: none)."""
        return getattr(self, accumulating().name)

    @property
    def micro_batch(self) -> int | None:
        """The batch of one forward: batch_size / accum_steps (None without a batch size)."""
        if self.effective_batch is None:
            return None
        return self.effective_batch // self.micro_steps

    def check_batch(self) -> None:
        """KnobError when the batch does not split into accum_steps equal micro-batches."""
        b, k = self.effective_batch, self.micro_steps
        if b is not None and b % k:
            raise KnobError(f"{resizing(BATCH_DIM).name} {b} does not split into {k} equal "
                            f"micro-batches: pick a multiple of {k} "
                            f"(e.g. {max(k, math.ceil(b / k) * k)})")

    def label(self) -> str:
        """Short and deterministic: "amp fp16, batch 64 (4 x 16), ckpt" ("as written" when
        nothing is set)."""
        batch, accum = resizing(BATCH_DIM), accumulating()
        parts = []
        for name, value in self._items:
            if name in (batch.name, accum.name):
                continue  # the batch and its split: first, in one part
            knob = KNOBS[name]
            short = knob.short
            if knob.kind == "bool":
                parts.append(short if value else f"no {short}")
            else:
                parts.append(f"{short} {value}".strip())
        b, k = self.effective_batch, self.micro_steps
        if b is not None or k != 1:
            noun = batch.sizes.noun if batch.sizes is not None else batch.name
            if k != 1:
                parts.insert(0, f"{noun} {b if b is not None else '?'} "
                                f"({k} x {self.micro_batch if b is not None else '?'})")
            else:
                parts.insert(0, f"{noun} {b}")
        return ", ".join(parts) if parts else _AS_WRITTEN

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._items)
        return f"Setting({inner})"
