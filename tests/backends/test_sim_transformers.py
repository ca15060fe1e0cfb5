"""transformers models on the notebook's one simulated GPU (issue 14, items 3, 4 and 12).

Tiny models built from configs only (nothing is downloaded), driven through IPython's
in-process shell as a notebook would: ``%%gpumem --backend sim`` cells share one
persistent simulated GPU, so a model built in one cell is trained in the next.
"""

from __future__ import annotations

import time

import pytest
import torch


transformers = pytest.importorskip("transformers")

from test_sim_compat import SDPARecorder  # noqa: E402  (one recorder for both files)

OPTS = "--backend sim --gpu T4 -o -q --no-chart"
BLOCK = 512  # the CUDA caching allocator rounds every tensor up to 512 B


def sim_cell(ip, src: str, opts: str = OPTS):
    """One ``%%gpumem`` cell on the shell's simulated GPU; its MemoryReport."""
    report = ip.run_cell_magic("gpumem", opts, src)
    assert report is not None
    return report


def rounded(sizes) -> int:
    return sum(-(-n // BLOCK) * BLOCK for n in sizes)


# -- 1. built in one cell, trained in the next -----------------------------------------------------
BUILD = {
    "gpt2": """\
import torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
                 bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(cfg).to("cuda")
""",
    "llama": """\
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
model = LlamaForCausalLM(cfg).to("cuda")
""",
}
AFTER_BUILD = """\
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
param_sizes = [p.numel() * p.element_size() for p in model.parameters()]
buffer_sizes = [b.numel() * b.element_size() for b in model.buffers() if b.is_cuda]
devices = sorted({str(p.device) for p in model.parameters()})
"""
TRAIN = """\
model.train()
losses = []
for step in range(3):
    ids = torch.randint(0, 128, (4, 32), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
allocated = torch.cuda.memory_allocated()
n_state = sum(len(s) for s in opt.state.values())
"""


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_model_built_in_one_cell_trains_in_the_next(ip, arch):
    first = sim_cell(ip, BUILD[arch] + AFTER_BUILD)
    assert first.error is None, first.error
    ns = ip.user_ns
    assert ns["devices"] == ["cuda:0"]
    params = rounded(ns["param_sizes"])
    buffers = rounded(ns["buffer_sizes"])
    assert params > 0
    assert first.before == 0
    assert first.breakdown["parameters"] == params
    assert first.after == params + buffers  # nothing else is left on the card

    second = sim_cell(ip, TRAIN)
    assert second.error is None, second.error
    # the first cell's model is the second cell's starting point
    assert second.before == first.after
    assert dict(second.breakdown_before)["parameters"] == params
    assert second.breakdown["parameters"] == params
    # AdamW: exp_avg and exp_avg_sq per parameter, the same size (step stays on the host)
    assert second.breakdown["optimizer_state"] == 2 * params
    assert second.breakdown["gradients"] == params
    assert second.breakdown["activations"] > 0
    assert second.peak >= second.after >= first.after + 3 * params
    assert ns["allocated"] == second.after
    assert ns["n_state"] == 3 * len(ns["param_sizes"])  # step, exp_avg, exp_avg_sq
    # a loss depends on data: a placeholder that says so, and the note names the line
    assert len(ns["losses"]) == 3 and "(simulated)" in repr(ns["losses"][0])
    assert "line 9" in " ".join(second.notes)

    # a third cell sees what the second left, and memory_allocated answers across cells
    third = sim_cell(ip, "now = torch.cuda.memory_allocated()\n")
    assert third.error is None, third.error
    assert third.before == second.after == ip.user_ns["now"]
    ip.run_line_magic("gpusim", "reset")
    fourth = sim_cell(ip, "empty = torch.cuda.memory_allocated()\n")
    assert fourth.before == 0 and ip.user_ns["empty"] == 0


def test_buffers_moved_to_the_gpu_count_as_buffers(ip):
    # LlamaRotaryEmbedding's inv_freq and original_inv_freq: two fp32 buffers of 8 -> 2 x 512 B
    first = sim_cell(ip, BUILD["llama"] + AFTER_BUILD)
    assert first.error is None, first.error
    buffers = rounded(ip.user_ns["buffer_sizes"])
    assert buffers == 2 * BLOCK
    assert first.breakdown["buffers"] == buffers and first.breakdown["other"] == 0


# -- 2. generate() stops at max_new_tokens -------------------------------------------------------
GENERATE = """\
import torch
from transformers import GPT2Config, GPT2LMHeadModel
cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64{extra})
model = GPT2LMHeadModel(cfg).to("cuda").eval()
input_ids = torch.randint(1, 128, (2, 7), device="cuda")
with torch.no_grad():
    out = model.generate(input_ids, max_new_tokens=5, do_sample=False)
shape = tuple(out.shape)
"""


def _generate(ip, extra: str) -> None:
    t0 = time.perf_counter()
    report = sim_cell(ip, GENERATE.format(extra=extra))
    took = time.perf_counter() - t0
    assert report.error is None, report.error
    assert ip.user_ns["shape"] == (2, 7 + 5)
    assert took < 30  # the simulation's budget is 120 s


@pytest.fixture
def short_budget(monkeypatch):
    """Simulated cells stop after 10 s instead of 120 s (a loop that never ends fails fast)."""
    from memmagic.backends.sim.backend import SimBackend

    init = SimBackend.__init__

    def short(self, *args, max_seconds: float = 10.0, **kwargs):
        init(self, *args, max_seconds=max_seconds, **kwargs)

    monkeypatch.setattr(SimBackend, "__init__", short)


def test_generate_without_an_eos_token_stops_at_max_new_tokens(ip):
    _generate(ip, ", bos_token_id=None, eos_token_id=None, pad_token_id=None")


def test_generate_with_an_eos_token_stops_at_max_new_tokens(ip, short_budget):
    # GPT2Config's default eos_token_id (50256) lies outside the tiny vocabulary: a GPU run
    # can never produce it, so it stops after exactly 5 new tokens
    _generate(ip, "")


# -- 3. values that do not depend on data are real -----------------------------------------------
TIMM_LIKE = """\
import torch, torch.nn as nn
dpr = [x.item() for x in torch.linspace(0, 0.0, 4)]
blocks = nn.ModuleList([nn.Identity() if r == 0 else nn.Dropout(r) for r in dpr])
kinds = [type(b).__name__ for b in blocks]
rates = torch.linspace(0, 0.1, 4).tolist()
gpu_rates = torch.linspace(0, 0.1, 4, device="cuda").tolist()
"""


def test_a_timm_like_drop_path_schedule_uses_the_real_values(ip):
    report = sim_cell(ip, TIMM_LIKE)
    assert report.error is None, report.error
    ns = ip.user_ns
    assert ns["dpr"] == [0.0, 0.0, 0.0, 0.0]
    assert ns["kinds"] == ["Identity"] * 4
    expected = torch.linspace(0, 0.1, 4).tolist()
    assert ns["rates"] == expected and ns["gpu_rates"] == expected
    assert all(type(v) is float for v in ns["rates"])  # plain numbers, not placeholders
    assert "depend on data were read" not in " ".join(report.notes)


# -- 4. gradient checkpointing + SDPA takes the GPU's path, across cells -------------------------
CKPT_BUILD = """\
import torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
                 bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
model = GPT2LMHeadModel(cfg).to({dev!r})
model.gradient_checkpointing_enable()
opt = torch.optim.AdamW(model.parameters())
"""
CKPT_STEP = """\
F = torch.nn.functional
rec.orig = F.scaled_dot_product_attention
F.scaled_dot_product_attention = rec
try:
    model.train()
    ids = torch.randint(0, 128, (2, 16), device={dev!r})
    loss = model(input_ids=ids, attention_mask={mask}, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
finally:
    F.scaled_dot_product_attention = rec.orig
"""
MASKS = {
    "none": "None",
    "ones": "torch.ones(2, 16, dtype=torch.long, device={dev!r})",
    "ones_like": "torch.ones_like(ids)",
    # a mask made for real in an earlier (non-sim) cell, as a tokenizer's would be
    "host": "host_mask.to({dev!r})",
}


@pytest.mark.parametrize("mask", [
    "none",
    "ones",
    "ones_like",
    "host",
])
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_checkpointed_sdpa_is_causal_like_an_eager_run_across_cells(ip, mask):
    host_mask = torch.ones(2, 16, dtype=torch.long)
    # the path a real (non-fake) run takes, on the CPU
    eager = SDPARecorder()
    ns: dict = {"rec": eager, "host_mask": host_mask}
    exec(CKPT_BUILD.format(dev="cpu"), ns)
    exec(CKPT_STEP.format(dev="cpu", mask=MASKS[mask].format(dev="cpu")), ns)
    assert len(eager.calls) == 4 and all(c == (True, None) for c in eager.calls)

    ip.user_ns["host_mask"] = host_mask  # made by a real cell
    first = sim_cell(ip, CKPT_BUILD.format(dev="cuda"))
    assert first.error is None, first.error
    rec = SDPARecorder()
    ip.user_ns["rec"] = rec
    second = sim_cell(ip, CKPT_STEP.format(dev="cuda", mask=MASKS[mask].format(dev="cuda")))
    assert second.error is None, second.error
    assert torch.nn.functional.scaled_dot_product_attention is rec.orig
    # forward, and the checkpointed recompute in backward: no (B,1,T,T) mask, is_causal=True
    assert rec.calls == eager.calls


# -- 5. BERT and ViT, and importing transformers inside a sim cell -------------------------------
BERT = """\
import transformers
from transformers import BertConfig, BertForSequenceClassification
cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=128, vocab_size=128, max_position_embeddings=64)
model = BertForSequenceClassification(cfg).cuda()
ids = torch.randint(0, 128, (4, 16), device="cuda")
labels = torch.randint(0, 2, (4,), device="cuda")
out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
out.loss.backward()
logits_shape = tuple(out.logits.shape)
n_grads = sum(p.grad is not None for p in model.parameters())
n_params = len(list(model.parameters()))
version = transformers.__version__
"""
VIT = """\
from transformers import ViTConfig, ViTForImageClassification
cfg = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=128, image_size=32, patch_size=8, num_labels=10)
model = ViTForImageClassification(cfg).to(device="cuda")
pixels = torch.randn(4, 3, 32, 32, device="cuda")
labels = torch.randint(0, 10, (4,), device="cuda")
out = model(pixel_values=pixels, labels=labels)
out.loss.backward()
logits_shape = tuple(out.logits.shape)
n_grads = sum(p.grad is not None for p in model.parameters())
n_params = len(list(model.parameters()))
"""
SIZES = """\
param_sizes = [p.numel() * p.element_size() for p in model.parameters()]
grad_sizes = [p.grad.numel() * p.grad.element_size() for p in model.parameters()]
buffer_sizes = [b.numel() * b.element_size() for b in model.buffers() if b.is_cuda]
allocated = torch.cuda.memory_allocated()
"""


@pytest.mark.parametrize("src, shape", [(BERT, (4, 2)), (VIT, (4, 10))], ids=["bert", "vit"])
def test_forward_and_backward_with_the_import_inside_the_cell(ip, src, shape):
    report = sim_cell(ip, src + SIZES)
    assert report.error is None, report.error
    ns = ip.user_ns
    assert ns["logits_shape"] == shape
    assert ns["n_grads"] == ns["n_params"] > 0
    params = rounded(ns["param_sizes"])
    assert report.breakdown["parameters"] == params
    assert rounded(ns["grad_sizes"]) == params
    assert report.breakdown["activations"] > 0
    # parameters, their gradients and what the names still hold (inputs, logits, loss)
    assert report.after == ns["allocated"] >= 2 * params + rounded(ns["buffer_sizes"])
    assert report.peak > report.after
    if "version" in ns:
        assert ns["version"] == transformers.__version__
