"""The benchmark matrix over the shared zoo (memmagic.zoo): case x {fp32, AMP} x
checkpointing {off, on}, and the callables each figure runs.

A *cell* is what a notebook cell of the tutorial does: build the model, an AdamW
optimizer and a batch, then train ``steps`` steps (``zoo.step_source`` writes the same
code as text). Building inside the cell makes every byte (parameters included) part of
the measured peak, so a real run, a simulated run and each peer estimate one number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from memmagic import zoo

__all__ = ["Config", "matrix", "cell_source", "runner", "warm_step", "sim_backend", "SIM_MISSING",
           "REAL_CPU_CASES", "ALL_CASES", "QUICK_CASES", "cpu_cannot_run", "LOOPS", "loop_source"]

REAL_CPU_CASES = ("mlp", "cnn", "transformer", "nanogpt", "lstm")
ALL_CASES = REAL_CPU_CASES + ("gpt2_small",)
QUICK_CASES = ("mlp", "transformer")
SIM_MISSING = "sim backend not available"


@dataclass(frozen=True)
class Config:
    case: str
    amp: bool
    ckpt: bool
    size: str = "bench"

    @property
    def label(self) -> str:
        return f"{self.case} {'amp' if self.amp else 'fp32'}{' ckpt' if self.ckpt else ''}"

    def row(self) -> dict[str, Any]:
        return {"case": self.case, "precision": "amp" if self.amp else "fp32",
                "ckpt": "on" if self.ckpt else "off", "size": self.size}


def matrix(cases: tuple[str, ...], size: str, *, quick: bool = False) -> list[Config]:
    """Every case in fp32 and AMP, checkpointing off and on (quick: off only)."""
    ckpts = (False,) if quick else (False, True)
    return [Config(c, amp, ck, size) for c in cases for amp in (False, True) for ck in ckpts]


def cell_source(cfg: Config, device: str = "cpu", *, steps: int = 1,
                batch_scale: float = 1.0) -> str:
    """Source of a notebook cell: build case ``cfg`` on ``device``, make AdamW, train
    ``steps`` steps (the code ``zoo.step_source`` writes). ``batch_scale`` resizes the
    batch along dim 0: the what-if batch-size knob."""
    lines = [
        "import torch",
        "from memmagic import zoo",
        f"model, batch = zoo.build({cfg.case!r}, device={device!r}, "
        f"checkpointing={cfg.ckpt!r}, size={cfg.size!r})",
    ]
    if batch_scale != 1.0:
        n = max(1, round(zoo.CASES[cfg.size][cfg.case].input_size[0] * batch_scale))
        lines += [
            f"_idx = torch.arange({n}, device=batch[0].device) % batch[0].shape[0]",
            "batch = tuple(t.index_select(0, _idx) for t in batch)",
        ]
    lines += [
        "opt = torch.optim.AdamW(model.parameters())",
        f"for _ in range({steps}):",
        f"    loss = zoo.train_step(model, opt, batch, amp={cfg.amp!r})",
    ]
    return "\n".join(lines) + "\n"


_BF16_LSTM: list[bool] = []


def cpu_cannot_run(cfg: Config) -> str | None:
    """Why this CPU cannot run ``cfg`` for real (None when it can): oneDNN has no bf16
    LSTM on CPUs without AVX-512 BF16 support, with or without memmagic."""
    if not (cfg.case == "lstm" and cfg.amp):
        return None
    if not _BF16_LSTM:
        lstm = torch.nn.LSTM(4, 4)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                lstm(torch.randn(2, 1, 4))
            _BF16_LSTM.append(True)
        except RuntimeError:
            _BF16_LSTM.append(False)
    return None if _BF16_LSTM[0] else "not run: this CPU's oneDNN has no bf16 LSTM kernel"


# Loops of several iterations (the accuracy figure on loops): forward-only loops, the
# classic `total += loss` that keeps every graph, and several training steps.
LOOPS = {
    "forward x4, total += loss.item()": (
        "total = 0.0\n"
        "for _ in range(4):\n"
        "    with torch.autocast('cpu', dtype=torch.bfloat16, enabled={amp!r}):\n"
        "        loss = model.loss(*batch)\n"
        "    total += loss.item()\n"),
    "forward x4, total += loss": (
        "total = 0\n"
        "for _ in range(4):\n"
        "    with torch.autocast('cpu', dtype=torch.bfloat16, enabled={amp!r}):\n"
        "        loss = model.loss(*batch)\n"
        "    total += loss\n"),
    "train x3": (
        "opt = torch.optim.AdamW(model.parameters())\n"
        "for _ in range(3):\n"
        "    loss = zoo.train_step(model, opt, batch, amp={amp!r})\n"),
}


def loop_source(cfg: Config, loop: str) -> str:
    """A cell that builds case ``cfg`` on the CPU and runs the loop ``loop`` of LOOPS."""
    return ("import torch\nfrom memmagic import zoo\n"
            f"model, batch = zoo.build({cfg.case!r}, device='cpu', checkpointing={cfg.ckpt!r}, "
            f"size={cfg.size!r})\n" + LOOPS[loop].format(amp=cfg.amp))


def runner(source: str) -> Callable[[dict], None]:
    """``run(ns)`` for ``Backend.execute``: execs the compiled cell in ``ns``."""
    code = compile(source, "<benchmark cell>", "exec")

    def run(ns: dict) -> None:
        exec(code, ns)

    return run


def warm_step(cfg: Config, device: str = "cpu") -> tuple[dict[str, Any], str]:
    """A namespace holding a built model, optimizer and batch after one warm-up step,
    and the source of one more training step (the cell the overhead figure times)."""
    model, batch = zoo.build(cfg.case, device, checkpointing=cfg.ckpt, size=cfg.size)
    opt = torch.optim.AdamW(model.parameters())
    zoo.train_step(model, opt, batch, amp=cfg.amp)
    ns = {"zoo": zoo, "model": model, "opt": opt, "batch": batch, "torch": torch}
    return ns, f"_loss = zoo.train_step(model, opt, batch, amp={cfg.amp!r})\n"


def sim_backend(**options: Any):
    """(backend, None) when memmagic's simulated backend imports and builds, else (None, why)."""
    try:
        from memmagic.backends.sim import SimBackend  # noqa: F401
        from memmagic.backends import get_backend

        return get_backend("sim", **options), None
    except Exception as exc:  # not written yet, or broken: say so, never invent numbers
        return None, f"{SIM_MISSING} ({type(exc).__name__}: {exc})"[:200]
