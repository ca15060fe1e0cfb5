"""The simulated GPU against published figures (issue 24, item 6): each test names its source
and the error against it. Sizes come from the simulation of the library's own code
(transformers, bitsandbytes) on full-size layers or configs; nothing is downloaded."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def test_llama2_7b_keeps_half_a_mebibyte_of_kv_cache_per_token_in_fp16(ip):
    """Published: about 0.5 MB of KV cache per token for Llama 2 7B in fp16, 2 x 32 layers x
    32 heads x 128 x 2 bytes = 524,288 B (and "about 5 GB" for a 10,000-token context:
    Hugging Face's post "Unlocking Longer Generation with Key-Value Cache Quantization",
    https://huggingface.co/blog/kv-cache-quantization).
    Simulated: the cache transformers' DynamicCache holds after a 16-token prefill."""
    ip.run_line_magic("gpusim", "on --gpu A100-80GB")
    ip.run_cell("""
import torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32)
model = LlamaForCausalLM(cfg).to("cuda", torch.float16).eval()
ids = torch.randint(0, 32000, (1, 16), device="cuda")
""")
    r = ip.run_cell_magic("gpumem", "-o -q --no-chart",
                          "with torch.no_grad():\n    out = model(input_ids=ids, use_cache=True)")
    per_token = r.breakdown["kv_cache"] / 16
    assert per_token == 524_288, f"error {per_token / 524_288 - 1:+.2%}"          # exact
    assert abs(10_000 * per_token / 5e9 - 1) < 0.05                              # "about 5 GB"


def _nf4_state_bits(ip, double_quant: bool) -> float:
    # (a Linear4bit and its weight refer to each other: an earlier one waits for the cycle
    # collector, on a GPU too)
    ip.run_cell("import gc, torch\nimport bitsandbytes as bnb\nlin = None\ngc.collect()\n"
                f"lin = bnb.nn.Linear4bit(4096, 4096, bias=False, quant_type='nf4', "
                f"compress_statistics={double_quant}).cuda()")
    r = ip.run_cell_magic("gpumem", "-o -q --no-chart", "y = lin(torch.randn(2, 4096, device='cuda'))")
    n = 4096 * 4096
    return (r.frozen_parameters - n // 2) * 8 / n  # the state beside the packed weights


def test_nf4_quantization_state_takes_the_bits_per_parameter_the_qlora_paper_gives(ip):
    """Published (Dettmers et al., QLoRA, 2023, section 3, Double Quantization): the
    quantization constants of blocks of 64 take 32/64 = 0.5 bits per parameter; double
    quantization takes them to 8/64 + 32/(64 x 256) = 0.127 bits. Simulated: the state
    bitsandbytes keeps beside a 4096 x 4096 NF4 weight (its code maps too)."""
    pytest.importorskip("bitsandbytes")
    ip.run_line_magic("gpusim", "on --gpu T4")
    plain = _nf4_state_bits(ip, double_quant=False)
    double = _nf4_state_bits(ip, double_quant=True)
    assert abs(plain / 0.5 - 1) < 0.001, f"error {plain / 0.5 - 1:+.3%}"        # 0.50024
    assert abs(double / 0.127 - 1) < 0.01, f"error {double / 0.127 - 1:+.3%}"   # 0.12793: +0.73%


def test_8bit_adam_takes_a_quarter_of_adams_state(ip):
    """Published (bitsandbytes docs, 8-bit optimizers: "75% less memory",
    https://huggingface.co/docs/bitsandbytes/v0.43.0/optimizers). Simulated: AdamW8bit's state
    (two uint8 moments, an fp32 absmax per 256 values, the code maps) against torch's AdamW
    (two fp32 moments) on a 4096 x 4096 weight."""
    pytest.importorskip("bitsandbytes")
    ip.run_line_magic("gpusim", "on --gpu T4")
    states = {}
    for name, opt in (("8bit", "bnb.optim.AdamW8bit"), ("32bit", "torch.optim.AdamW")):
        ip.run_cell("import torch\nimport bitsandbytes as bnb\n"
                    "m = torch.nn.Linear(4096, 4096, bias=False).cuda()\n"
                    f"opt = {opt}(m.parameters())\n"
                    "m(torch.randn(2, 4096, device='cuda')).sum().backward()")
        r = ip.run_cell_magic("gpumem", "-o -q --no-chart", "opt.step()")
        states[name] = r.breakdown["optimizer_state"]
    assert states["32bit"] == 2 * 4096 * 4096 * 4
    saving = 1 - states["8bit"] / states["32bit"]                                # 74.61%
    assert abs(saving - 0.75) < 0.01, f"saving {saving:.2%} against 75%"


def test_lora_on_mt0_large_trains_the_parameters_peft_publishes(ip):
    """Published: peft's README quick tour, LoRA r=8 on bigscience/mt0-large:
    "trainable params: 2359296 || all params: 1231940608 || trainable%: 0.1915"
    (https://github.com/huggingface/peft#quickstart).
    Simulated: the model built from mt0-large's config on the simulated GPU; every fp32
    tensor's size is a multiple of 512 B, so the bytes are 4 x the parameters exactly."""
    pytest.importorskip("peft")
    ip.run_line_magic("gpusim", "on --gpu A100-80GB")
    ip.run_cell("""
import torch
from transformers import MT5Config, MT5ForConditionalGeneration
from peft import LoraConfig, TaskType, get_peft_model
cfg = MT5Config(vocab_size=250112, d_model=1024, d_kv=64, d_ff=2816, num_layers=24,
                num_decoder_layers=24, num_heads=16, feed_forward_proj="gated-gelu")
model = get_peft_model(MT5ForConditionalGeneration(cfg),
                       LoraConfig(task_type=TaskType.SEQ_2_SEQ_LM, inference_mode=False, r=8,
                                  lora_alpha=32, lora_dropout=0.1)).cuda()
""")
    r = ip.run_cell_magic("gpumem", "-o -q --no-chart", "n = sum(1 for p in model.parameters())")
    trainable = r.breakdown["parameters"] - r.frozen_parameters
    assert trainable == 4 * 2_359_296, f"error {trainable / (4 * 2_359_296) - 1:+.2%}"  # exact
    # the published total counts an lm_head of its own (250,112 x 1,024); transformers 5
    # ties mT5's lm_head to the shared embedding whatever the config says
    # (MT5Config.__post_init__), so this model holds one fewer
    assert r.breakdown["parameters"] == 4 * (1_231_940_608 - 250_112 * 1024)       # exact
