"""Fine-tuning LLMs on the simulated GPU (issue 24): LoRA with peft on a transformers
model built from a config (no download): the frozen base gets no gradients and no
optimizer state, the breakdown splits trainable from frozen parameters."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

CUBLAS = 8519680  # one cuBLAS workspace on a T4 (2 x 4 MiB + 8 x 16 KiB), per thread


def rnd(n: int) -> int:
    return -(-n // 512) * 512


LORA = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from peft import LoraConfig, get_peft_model
cfg = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=8, target_modules=["q_proj", "v_proj"])).cuda()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
ids = torch.randint(0, 8000, (4, 256), device="cuda")
"""
STEP = "loss = model(input_ids=ids, labels=ids).loss\nloss.backward()\nopt.step(); opt.zero_grad()"


def test_lora_splits_trainable_from_frozen_parameters_and_trains_only_the_adapters(ip):
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell(LORA)
    first = ip.run_cell_magic("gpumem", "-o -q --no-chart", STEP)
    # adapters: 4 layers x (q, v) x (A: 8 x 512 + B: 512 x 8) fp32 = 262,144 B
    trainable = 4 * 2 * (rnd(8 * 512 * 4) + rnd(512 * 8 * 4))
    d, i, v = 512, 1376, 8000
    layer = [d * d] * 4 + [d * i] * 3 + [d, d]     # q k v o, gate up down, two RMSNorms
    frozen = 2 * rnd(v * d * 4) + 4 * sum(rnd(n * 4) for n in layer) + rnd(d * 4)
    assert first.frozen_parameters == frozen                       # 83,380,224 B
    assert first.breakdown["parameters"] == frozen + trainable
    assert "(trainable 256.00 KiB, frozen 79.52 MiB)" in first.summary()
    # the step left AdamW's two moments of the adapters only, and the cuBLAS workspaces of
    # the first matmuls (main and autograd thread), and `loss` (a scalar, one 512-byte
    # block); zero_grad(set_to_none) dropped the gradients
    assert first.after - first.before == 2 * trainable + 2 * CUBLAS + 512
    again = ip.run_cell_magic("gpumem", "-o -q --no-chart", STEP)
    assert again.after == again.before and again.frozen_parameters == frozen


def test_a_model_with_every_parameter_trainable_says_nothing_of_frozen(ip):
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell("import torch\nm = torch.nn.Linear(256, 256).cuda()\nx = torch.randn(8, 256, device='cuda')")
    r = ip.run_cell_magic("gpumem", "-o -q --no-chart", "m(x).sum().backward()")
    assert r.frozen_parameters == 0 and "frozen" not in r.summary()
    ip.run_cell("m.weight.requires_grad_(False)")
    r = ip.run_cell_magic("gpumem", "-o -q --no-chart", "m(x).sum().backward()")
    assert r.frozen_parameters == 256 * 256 * 4 and "frozen 256.00 KiB" in r.summary()


# -- inference: the KV cache is its own category (issue 24, item 4) -------------------------
LLAMA = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
model = LlamaForCausalLM(cfg).cuda().eval()
ids = torch.randint(3, 8000, (4, 128), device="cuda")
"""
GENERATE = ("out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, "
            "cache_implementation={!r})")


def test_generate_counts_its_key_value_cache_as_a_category(ip):
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell(LLAMA)
    dyn = ip.run_cell_magic("gpumem", "-o -q --no-chart", GENERATE.format("dynamic"))
    # the peak is in the prefill (the 128-token MLP): the dynamic cache then holds K and V of
    # 4 layers, each [batch 4, kv heads 2, 128 tokens, head dim 64] fp32 = 262,144 B
    assert dyn.error is None and dyn.peak_phase == "forward"
    assert dyn.breakdown["kv_cache"] == 4 * 2 * (4 * 2 * 128 * 64 * 4)      # 2,097,152 B
    assert "kv_cache" in dyn.summary()
    static = ip.run_cell_magic("gpumem", "-o -q --no-chart", GENERATE.format("static"))
    # the static cache is allocated for the whole length first: 128 + 32 - 1 = 159 positions
    # (the last token is never fed back), with each layer's small position counter
    full = 4 * 2 * (4 * 2 * 159 * 64 * 4)                                   # 2,605,056 B
    assert full <= static.breakdown["kv_cache"] <= full + 4 * 1024
    assert static.breakdown["kv_cache"] > dyn.breakdown["kv_cache"]


def test_a_report_without_a_cache_does_not_list_the_category(ip):
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell("import torch\nm = torch.nn.Linear(64, 64).cuda()\nx = torch.randn(8, 64, device='cuda')")
    r = ip.run_cell_magic("gpumem", "-o -q --no-chart", "m(x).sum().backward()")
    assert r.breakdown["kv_cache"] == 0 and "kv_cache" not in r.summary()


# -- quantized weights the simulation cannot make (issue 24, item 3: the one-line refusal) --
def test_bitsandbytes_4bit_weights_are_refused_in_one_line_that_says_what(ip):
    pytest.importorskip("bitsandbytes")
    from memmagic.backends.sim.errors import SimulationUnsupported

    ip.run_line_magic("gpusim", "on --gpu T4")
    result = ip.run_cell("import bitsandbytes as bnb\n"
                         "lin = bnb.nn.Linear4bit(256, 256, quant_type='nf4').cuda()")
    err = result.error_in_exec
    assert isinstance(err, SimulationUnsupported)
    text = str(err)
    assert len(text.splitlines()) == 1
    assert "`Params4bit` is a tensor subclass" in text and "not simulated" in text
    assert "line 2" in text


# -- inference knobs: new tokens (issue 24, item 4) -----------------------------------------
# a 2-layer model and an 8-token prompt, so that a few new tokens make the cache outgrow the
# prefill's transients (and the test stays short: each new token is one simulated step)
SHORT = (LLAMA.replace("num_hidden_layers=4", "num_hidden_layers=2")
         .replace("(4, 128)", "(4, 8)"))


def test_new_tokens_sets_max_new_tokens_on_each_generate_call(ip):
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell(SHORT)
    step = GENERATE.format("dynamic").replace(", min_new_tokens=32", "")
    base = ip.run_cell_magic("gpumem", "-o -q --no-chart", step)
    more = ip.run_cell_magic("gpumem", "--new-tokens 96 -o -q --no-chart", step)
    assert more.error is None and more.peak > base.peak
    assert any("new_tokens 96: each generate() call ran with max_new_tokens=96" in n
               for n in more.notes)
    # the peak is now at the last step: the cache holds 8 + 96 - 1 = 103 positions of
    # 2 layers x K, V x [batch 4, kv heads 2, head dim 64] fp32
    assert more.breakdown["kv_cache"] == 2 * 2 * (4 * 2 * 103 * 64 * 4)   # 843,776 B


def test_a_cell_that_reads_max_new_tokens_gets_a_slider(ip):
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell(SHORT + "max_new_tokens = 16")
    step = ("out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, "
            "cache_implementation='dynamic')")
    panel = ip.run_cell_magic("gpumem", "--whatif -o -q", step)
    assert panel.baseline.new_tokens == 16 and "new_tokens" in panel.controls
    panel.set(new_tokens=64)
    assert panel.error is None and panel.report.peak > panel.baseline_report.peak
    assert any("new tokens 64" in n for n in panel.report.notes)
    assert ip.user_ns["max_new_tokens"] == 16


def test_new_tokens_applies_to_a_cell_that_generates_only():
    import torch

    from memmagic import Cell

    ns = {"torch": torch, "m": torch.nn.Linear(8, 8)}
    cell = Cell("y = m(torch.randn(2, 8)).sum()", ns, backend="cpu")
    assert "new_tokens" not in cell.applicable()
