"""A training script in the style of nanoGPT's ``train.py`` (written here, in our own words):
settings are module globals that a small configurator overrides from ``--key=value`` flags,
a GPT is defined in the script, ``estimate_loss()`` averages the loss over a few batches of
each split under ``torch.no_grad()`` between ``model.eval()`` and ``model.train()``, the
loop trains in fp16 under ``torch.amp.autocast`` with a ``torch.amp.GradScaler`` and
gradient accumulation, logs with f-strings, writes ``ckpt.pt`` with ``torch.save`` into
``out_dir`` and at the end reads it back with ``torch.load`` (as a resumed run would); with
``--sample_tokens=N`` it then samples N tokens as nanoGPT's ``sample.py`` does (``generate``
calls the model on all the tokens so far, cropped to the block, under ``torch.no_grad()``).

Exercises: a configurator that rewrites ``globals()``; ``.item()`` and a format spec on a
0-d tensor (the numbers a simulation does not have: they print marked ``(simulated)``);
fused AdamW with weight-decay groups; ``torch.save``/``torch.load`` over the scratch disk
(nothing written to the real one).

Run: ``python -m memmagic run --gpu T4 nanogpt_train.py --max_iters=4 --compile=False``."""

import inspect
import math
import os
import sys
import time
from ast import literal_eval
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

# -- settings (each can be overridden on the command line: --batch_size=16) ------------------------
out_dir = "out-tiny"
eval_interval = 2
log_interval = 1
eval_iters = 2
always_save_checkpoint = True
gradient_accumulation_steps = 2
batch_size = 8
block_size = 64
vocab_size = 512
n_layer = 2
n_head = 2
n_embd = 64
dropout = 0.0
bias = False
learning_rate = 1e-3
max_iters = 20
weight_decay = 1e-1
beta1, beta2 = 0.9, 0.99
grad_clip = 1.0
warmup_iters = 2
lr_decay_iters = 20
min_lr = 1e-4
device = "cuda"
dtype = "float16"  # a T4 has no bf16 tensor cores
compile = True
sample_tokens = 0  # tokens sampled after training, as sample.py would (0: none)
temperature = 0.8
top_k = 200


def apply_overrides(argv, namespace):
    """The configurator: each ``--key=value`` replaces a setting that already exists, the
    value read as a Python literal where it is one (``--compile=False``), else kept as text."""
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise SystemExit(f"unrecognised argument {arg!r}: use --key=value")
        key, text = arg[2:].split("=", 1)
        if key not in namespace:
            raise SystemExit(f"unknown setting {key!r}")
        try:
            value = literal_eval(text)
        except (SyntaxError, ValueError):
            value = text
        if type(value) is not type(namespace[key]):
            raise SystemExit(f"--{key} wants a {type(namespace[key]).__name__}, got {text!r}")
        print(f"setting {key} = {value!r}")
        namespace[key] = value


config_keys = [k for k, v in globals().items()
               if not k.startswith("_") and isinstance(v, (int, float, bool, str))]
apply_overrides(sys.argv[1:], globals())
config = {k: globals()[k] for k in config_keys}
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size
print(f"tokens per iteration will be: {tokens_per_iter:,}")

os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

# -- data: a random token stream stands in for train.bin / val.bin ---------------------------------
rng = np.random.default_rng(0)
splits = {"train": rng.integers(0, vocab_size, 20_000, dtype=np.uint16),
          "val": rng.integers(0, vocab_size, 2_000, dtype=np.uint16)}


def get_batch(split):
    data = splits[split]
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device_type == "cuda":
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    else:
        x, y = x.to(device), y.to(device)
    return x, y


# -- the model -----------------------------------------------------------------------------------
@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 512
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = False


class SelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = SelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = FeedForward(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied: one tensor, counted once
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.config.block_size, f"sequence of {t} is longer than the block ({self.config.block_size})"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
        print(f"decayed tensors: {len(groups[0]['params'])}, "
              f"non-decayed tensors: {len(groups[1]['params'])}")
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        print(f"using fused AdamW: {fused}")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)


model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                  bias=bias, vocab_size=vocab_size, dropout=dropout)
model = GPT(GPTConfig(**model_args))
print(f"number of parameters: {model.num_params() / 1e6:.2f}M")
model.to(device)
scaler = torch.amp.GradScaler("cuda", enabled=(dtype == "float16"))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if compile:
    print("compiling the model...")
    model = torch.compile(model)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


# -- training ------------------------------------------------------------------------------------
X, Y = get_batch("train")
t0 = time.time()
iter_num, best_val_loss = 0, 1e9
ckpt_path = os.path.join(out_dir, "ckpt.pt")
while True:
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group["lr"] = lr
    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses["val"]
            if iter_num > 0:
                checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                              "model_args": model_args, "iter_num": iter_num,
                              "best_val_loss": best_val_loss, "config": config}
                print(f"saving checkpoint to {out_dir}")
                torch.save(checkpoint, ckpt_path)
    for micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")  # the next batch while the GPU works on this one
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % log_interval == 0:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, lr {lr:.2e}")
    iter_num += 1
    if iter_num > max_iters:
        break

# -- resume: read the checkpoint back, as `init_from = "resume"` would ----------------------------
checkpoint = torch.load(ckpt_path, map_location=device)
for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size"):
    assert checkpoint["model_args"][k] == model_args[k], k
model.load_state_dict(checkpoint["model"])
optimizer.load_state_dict(checkpoint["optimizer"])
print(f"resumed from iteration {checkpoint['iter_num']}, best val loss {checkpoint['best_val_loss']:.4f}")
checkpoint = None  # free the loaded copy

# -- sampling, as sample.py does with the model it loads -------------------------------------------
if sample_tokens:
    model.eval()
    start = torch.zeros((1, 1), dtype=torch.long, device=device)
    with ctx:
        y = model.generate(start, sample_tokens, temperature=temperature, top_k=top_k)
    print(f"sampled {y.size(1) - 1} tokens; the first ten: {y[0, 1:11].tolist()}")
