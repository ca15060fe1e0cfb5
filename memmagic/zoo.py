"""Small reference models and a training step, shared by the tests, the benchmarks and
the tutorial notebooks.

Each case builds a model whose blocks can be checkpointed, a batch, and a loss. Sizes are
chosen so a real CPU step takes well under a second (except ``gpt2_small``, which is the
124M-parameter GPT-2 shape, meant for the simulated device).

>>> model, batch = build("mlp", device="cpu")
>>> loss = train_step(model, torch.optim.Adam(model.parameters()), batch)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["CASES", "Case", "build", "train_step", "step_source", "ZooModel"]


class ZooModel(nn.Module):
    """Embedding/stem -> blocks -> head; ``checkpointing=True`` recomputes each block."""

    def __init__(self, stem: nn.Module, blocks: list[nn.Module], head: nn.Module,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.stem, self.blocks, self.head = stem, nn.ModuleList(blocks), head
        self._loss = loss
        self.checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            if self.checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._loss(self(x), y)


def _ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# -- blocks -----------------------------------------------------------------------------
class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return F.relu(self.fc(x))


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class SDPAttention(nn.Module):
    """Causal self-attention through scaled_dot_product_attention, with dropout."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads, self.p = nn.Linear(d, 3 * d), nn.Linear(d, d), heads, dropout

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0,
                                           is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class ManualAttention(nn.Module):
    """nanoGPT-style attention written out: q @ k^T, mask, softmax, dropout, @ v."""

    def __init__(self, d: int, heads: int, dropout: float, block: int) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads
        self.drop = nn.Dropout(dropout)
        self.register_buffer("mask", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        att = att.masked_fill(self.mask[:, :, :s, :s] == 0, float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        return self.proj((att @ v).transpose(1, 2).reshape(b, s, d))


class TransformerBlock(nn.Module):
    def __init__(self, d: int, attn: nn.Module, dropout: float) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), attn, nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LSTMBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d, d, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0]


class Embed(nn.Module):
    def __init__(self, vocab: int, d: int, block: int, dropout: float) -> None:
        super().__init__()
        self.tok, self.pos, self.drop = nn.Embedding(vocab, d), nn.Embedding(block, d), nn.Dropout(dropout)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos))


# -- cases ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One zoo entry: ``make_model()`` (builds on the current default device) and
    ``make_batch(device)`` returning (inputs, targets)."""

    name: str
    description: str
    make_model: Callable[[], ZooModel]
    make_batch: Callable[[str | torch.device], tuple[torch.Tensor, torch.Tensor]]
    input_size: tuple[int, ...]
    input_dtype: torch.dtype = torch.float32


def _mlp(width: int = 1024) -> ZooModel:
    return ZooModel(nn.Sequential(nn.Flatten(), nn.Linear(784, width), nn.ReLU()),
                    [MLPBlock(width) for _ in range(3)], nn.Linear(width, 10), F.cross_entropy)


def _cnn(width: int = 64) -> ZooModel:
    return ZooModel(ConvBlock(3, 32), [ConvBlock(32, width), ConvBlock(width, width),
                                       ConvBlock(width, width)],
                    nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10)),
                    F.cross_entropy)


def _gpt(attn: str, vocab: int, d: int, heads: int, layers: int, block: int,
         dropout: float = 0.1) -> ZooModel:
    def att() -> nn.Module:
        if attn == "sdpa":
            return SDPAttention(d, heads, dropout)
        return ManualAttention(d, heads, dropout, block)
    head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, vocab, bias=False))
    return ZooModel(Embed(vocab, d, block, dropout),
                    [TransformerBlock(d, att(), dropout) for _ in range(layers)], head, _ce)


def _lstm(width: int = 256, vocab: int = 1000) -> ZooModel:
    return ZooModel(nn.Embedding(vocab, width), [LSTMBlock(width) for _ in range(2)],
                    nn.Linear(width, vocab), _ce)


def _tokens(batch: int, seq: int, vocab: int):
    def make(device):
        g = torch.Generator().manual_seed(0)
        x = torch.randint(vocab, (batch, seq), generator=g)
        y = torch.randint(vocab, (batch, seq), generator=g)
        return x.to(device), y.to(device)
    return make


def _images(batch: int, shape: tuple[int, ...], classes: int):
    def make(device):
        g = torch.Generator().manual_seed(0)
        return (torch.randn(batch, *shape, generator=g).to(device),
                torch.randint(classes, (batch,), generator=g).to(device))
    return make


# size "test": a real CPU step well under a second (tests). "bench": twice the width and a
# realistic training batch (8x the test batch): the same ops on bigger tensors, so a real
# CPU step takes seconds while a simulated one (whose cost is per op) does not grow.
CASES: dict[str, dict[str, Case]] = {"test": {}, "bench": {}}
for _size, _k, _b in (("test", 1, 1), ("bench", 2, 8)):
    for _c in [
        Case("mlp", f"5-layer MLP, 784-{1024 * _k}x4-10, batch {64 * _b}",
             lambda k=_k: _mlp(1024 * k), _images(64 * _b, (1, 28, 28), 10), (64 * _b, 1, 28, 28)),
        Case("cnn", f"4 conv+BatchNorm blocks (width {32 * (_k + 1)}) on 32x32 images, batch {32 * _b}",
             lambda k=_k: _cnn(32 * (k + 1)), _images(32 * _b, (3, 32, 32), 10),
             (32 * _b, 3, 32, 32)),
        Case("transformer", f"2-layer transformer, SDPA attention with dropout, d=256, seq {128 * _k}, batch {8 * _b}",
             lambda k=_k: _gpt("sdpa", 1000, 256, 4, 2, 128 * k), _tokens(8 * _b, 128 * _k, 1000),
             (8 * _b, 128 * _k), torch.long),
        Case("nanogpt", f"2-layer nanoGPT-style hand-written attention, d=256, seq {128 * _k}, batch {8 * _b}",
             lambda k=_k: _gpt("manual", 1000, 256, 4, 2, 128 * k), _tokens(8 * _b, 128 * _k, 1000),
             (8 * _b, 128 * _k), torch.long),
        Case("lstm", f"embedding + 2 LSTM layers ({256 * _k}), seq 64, batch {16 * _b}",
             lambda k=_k: _lstm(256 * k), _tokens(16 * _b, 64, 1000), (16 * _b, 64), torch.long),
        Case("gpt2_small", "GPT-2 small shape: 124M parameters, seq 1024, batch 8 (simulate it)",
             lambda: _gpt("sdpa", 50257, 768, 12, 12, 1024), _tokens(8, 1024, 50257), (8, 1024),
             torch.long),
    ]:
        CASES[_size][_c.name] = _c

SMALL = ("mlp", "cnn", "transformer", "nanogpt", "lstm")


def build(name: str, device: str | torch.device = "cpu", *, checkpointing: bool = False,
          seed: int = 0, size: str = "test") -> tuple[ZooModel, tuple[torch.Tensor, torch.Tensor]]:
    """The model of case ``name`` on ``device`` and one batch (``size``: "test" or "bench")."""
    if size not in CASES:
        raise ValueError(f"size must be 'test' or 'bench', not {size!r}")
    if name not in CASES[size]:
        raise ValueError(f"unknown zoo case {name!r}; choose from {', '.join(CASES[size])}")
    case = CASES[size][name]
    torch.manual_seed(seed)
    with torch.device(device):
        model = case.make_model()
    model.checkpointing = checkpointing
    return model, case.make_batch(device)


def train_step(model: ZooModel, opt: torch.optim.Optimizer, batch, *, amp: bool = False,
               scaler: "torch.amp.GradScaler | None" = None) -> torch.Tensor:
    """One step: forward (under autocast when ``amp``), backward, optimizer step, zero_grad."""
    x, y = batch
    device_type = x.device.type
    dtype = torch.float16 if device_type == "cuda" else torch.bfloat16
    with torch.autocast(device_type, dtype=dtype, enabled=amp):
        loss = model.loss(x, y)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def step_source(name: str, *, device: str = "cuda", amp: bool = False,
                checkpointing: bool = False, steps: int = 1, size: str = "test") -> str:
    """A notebook cell (source text) that builds case ``name`` and trains ``steps`` steps."""
    return (
        "import torch\n"
        "from memmagic import zoo\n"
        f"model, batch = zoo.build({name!r}, device={device!r}, checkpointing={checkpointing!r}, size={size!r})\n"
        "opt = torch.optim.AdamW(model.parameters())\n"
        f"for _ in range({steps}):\n"
        f"    loss = zoo.train_step(model, opt, batch, amp={amp!r})\n"
    )
