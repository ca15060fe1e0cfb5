"""Fine-tuning LLMs on the simulated GPU (issue 24): LoRA with peft on a transformers
model built from a config (no download): the frozen base gets no gradients and no
optimizer state, the breakdown splits trainable from frozen parameters."""

from __future__ import annotations

import pytest
import torch

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


# -- quantized weights as users load them (issue 24, item 3) ---------------------------------
def _qstate(n: int) -> int:
    """Bytes of the quantization state bitsandbytes keeps beside an nf4 weight of n elements
    with double quantization (blocks of 64, their absmax quantized in blocks of 256): absmax
    uint8 n/64, the nested absmax fp32 per 256 blocks, the nf4 code (16 fp32), the offset (one
    fp32) and the nested state's copy of the 8-bit code (256 fp32), each a 512-byte block."""
    return rnd(n // 64) + rnd(-(-n // 64 // 256) * 4) + rnd(16 * 4) + rnd(4) + rnd(256 * 4)


def test_a_bitsandbytes_4bit_layer_holds_packed_weights_and_its_quantization_state(ip):
    pytest.importorskip("bitsandbytes")
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell("import torch\nimport bitsandbytes as bnb\n"
                "lin = bnb.nn.Linear4bit(256, 256, bias=False, quant_type='nf4', "
                "compute_dtype=torch.bfloat16).cuda()\n"
                "w = (isinstance(lin.weight, bnb.nn.Params4bit), lin.weight.dtype, tuple(lin.weight.shape))")
    assert ip.user_ns["w"] == (True, torch.uint8, (32768, 1))
    r = ip.run_cell_magic("gpumem", "-o -q --no-chart",
                          "x = torch.randn(8, 256, device='cuda', dtype=torch.bfloat16, requires_grad=True)\n"
                          "lin(x).sum().backward()")
    # 65,536 weights at 4 bits = 32,768 B, and 3,584 B of quantization state
    assert r.frozen_parameters == r.breakdown["parameters"] == 32768 + _qstate(256 * 256)  # 36,352 B
    assert any(n.startswith("bitsandbytes kernels ran (dequantize_4bit") and "not counted" in n
               for n in r.notes)
    # the what-if panel copies the card (a deep copy of the 4-bit weight) and re-runs
    panel = ip.run_cell_magic("gpumem", "--whatif -o -q",
                              "x = torch.randn(8, 256, device='cuda', dtype=torch.bfloat16, requires_grad=True)\n"
                              "lin(x).sum().backward()")
    panel.set(batch_size=64)
    assert panel.error is None and panel.report.frozen_parameters == 32768 + _qstate(256 * 256)
    assert panel.report.peak > panel.baseline_report.peak


def _save_small_llama(path) -> None:
    """A 2-layer Llama checkpoint on disk (d 512, ffn 1376, vocab 8000, fp32): what
    from_pretrained loads in the tests, with no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1376,
                                 num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                                 tie_word_embeddings=False)).save_pretrained(path)


def test_qlora_from_pretrained_with_a_bitsandbytes_config(ip, tmp_path):
    """The QLoRA recipe as users write it, on a checkpoint saved here (no download)."""
    pytest.importorskip("bitsandbytes")
    _save_small_llama(tmp_path)
    ip.run_line_magic("gpusim", "on --gpu T4")
    result = ip.run_cell(f"""
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
bnb_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)
model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, quantization_config=bnb_config,
                                             device_map="cuda")
model = prepare_model_for_kbit_training(model)
model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
ids = torch.randint(0, 8000, (4, 128), device="cuda")
""")
    assert result.error_in_exec is None
    r = ip.run_cell_magic("gpumem", "-o -q --no-chart", STEP)
    # per layer: q k v o (262,144 weights) and gate up down (704,512) in nf4, two layers
    packed = 2 * (4 * rnd(262144 // 2) + 3 * rnd(704512 // 2))                # 3,162,112 B
    state = 2 * (4 * _qstate(262144) + 3 * _qstate(704512))                   # 136,192 B
    # embeddings, lm_head and the RMSNorms stay fp32, frozen by prepare_model_for_kbit_training
    plain = 2 * rnd(8000 * 512 * 4) + 5 * rnd(512 * 4)                        # 32,778,240 B
    assert r.frozen_parameters == packed + state + plain
    trainable = 2 * 2 * (rnd(8 * 512 * 4) + rnd(512 * 8 * 4))                 # 131,072 B
    assert r.breakdown["parameters"] == packed + state + plain + trainable
    assert r.error is None and any("bitsandbytes kernels ran" in n for n in r.notes)


def test_8bit_weights_and_an_8bit_optimizer_count_at_their_real_sizes(ip):
    pytest.importorskip("bitsandbytes")
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell("import torch\nimport bitsandbytes as bnb\n"
                "lin8 = bnb.nn.Linear8bitLt(256, 256, bias=False, has_fp16_weights=False).cuda()")
    r = ip.run_cell_magic("gpumem", "-o -q --no-chart",
                          "x = torch.randn(8, 256, device='cuda', dtype=torch.float16)\ny = lin8(x)")
    # int8 weights (65,536 B) and one fp32 scale per row (SCB, 1,024 B)
    assert r.frozen_parameters == 256 * 256 + 256 * 4
    ip.run_cell("m = torch.nn.Linear(1024, 1024).cuda()\nopt = bnb.optim.AdamW8bit(m.parameters())")
    r = ip.run_cell_magic("gpumem", "-o -q --no-chart",
                          "m(torch.randn(8, 1024, device='cuda')).sum().backward()\nopt.step()")
    # the weight's two moments in uint8 (1 MiB each) with an fp32 absmax per 256 values, the
    # signed and unsigned 8-bit code maps (256 fp32 each); the bias (1,024 values, under
    # bitsandbytes' 4,096-value minimum for 8 bits) keeps two fp32 moments
    n = 1024 * 1024
    assert r.breakdown["optimizer_state"] == (2 * n + 2 * (n // 256 * 4) + 2 * 256 * 4
                                              + 2 * rnd(1024 * 4))           # 2,140,160 B


def test_a_paged_optimizer_keeps_its_state_off_the_card_and_says_so(ip):
    pytest.importorskip("bitsandbytes")
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell("import torch\nimport bitsandbytes as bnb\n"
                "m = torch.nn.Linear(1024, 1024).cuda()\nopt = bnb.optim.PagedAdamW(m.parameters())\n"
                "m(torch.randn(8, 1024, device='cuda')).sum().backward()")
    r = ip.run_cell_magic("gpumem", "-o -q --no-chart", "opt.step()")
    # the weight's two fp32 moments (4 MiB each) are unified memory: on the host here; the
    # bias's (1,024 values, under the 100,000-value paging threshold) are ordinary CUDA memory
    assert r.error is None and r.breakdown["optimizer_state"] == 2 * rnd(1024 * 4)
    assert r.host_peak >= 2 * 1024 * 1024 * 4
    assert any(n.startswith("paged optimizer state (8.00 MiB) is CUDA unified memory") for n in r.notes)


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


# -- torchao's weight-only int8 and int4 (issue 24, item 3) ------------------------------------
TORCHAO = """
import torch
from torchao.quantization import quantize_, Int8WeightOnlyConfig, Int4WeightOnlyConfig
m = torch.nn.Sequential(torch.nn.Linear(1024, 4096, bias=False),
                        torch.nn.Linear(4096, 1024, bias=False)).cuda().to(torch.bfloat16)
quantize_(m[0], Int8WeightOnlyConfig())
quantize_(m[1], Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"))
batch_size = 8
"""
# int8, per output row: 4096 x 1024 int8 values, a fp32 scale and an int8 zero point per row
INT8 = rnd(4096 * 1024) + rnd(4096 * 4) + rnd(4096)                    # 4,214,784 B
# int4 (tinygemm's tile-packed layout): 1024 x 4096 values at 4 bits, and per group of 128
# inputs and output row a bf16 scale and zero point: 32 groups x 1024 rows x 2 x 2 B
INT4 = rnd(1024 * 4096 // 2) + rnd(4096 // 128 * 1024 * 2 * 2)          # 2,228,224 B


def test_torchao_int8_and_int4_weights_count_at_their_real_sizes(ip):
    pytest.importorskip("torchao")
    ip.run_line_magic("gpusim", "on --gpu A100-80GB")
    assert ip.run_cell(TORCHAO).error_in_exec is None
    ip.run_cell("kinds = [type(l.weight).__name__ for l in m]\nheld = torch.cuda.memory_allocated()")
    assert ip.user_ns["kinds"] == ["Int8Tensor", "Int4TilePackedTo4dTensor"]
    assert ip.user_ns["held"] == INT8 + INT4                              # 6,443,008 B
    step = "x = torch.randn(batch_size, 1024, device='cuda', dtype=torch.bfloat16)\ny = m(x)"
    r = ip.run_cell_magic("gpumem", "-o -q --no-chart", step)
    assert r.before == INT8 + INT4 and r.frozen_parameters == r.breakdown["parameters"] == INT8 + INT4
    # int8 weight-only dequantizes the weight for its matmul (torchao's eager code, the same
    # on a GPU): 4096 x 1024 bf16 = 8 MiB at the peak beside the inputs and the weights
    assert r.peak_module == "m.0" and r.breakdown["other"] >= 4096 * 1024 * 2
    assert any(n.startswith("torch's packed-weight kernels ran (_weight_int4pack_mm)")
               and "not counted" in n for n in r.notes)
    # the quantized weights stay the same objects on the card from cell to cell
    ip.run_cell("w0 = m[0].weight")
    ip.run_cell("same = w0 is m[0].weight\nheld = torch.cuda.memory_allocated()")
    assert ip.user_ns["same"] is True
    # the what-if panel re-runs on a copy of the card, quantized weights included
    panel = ip.run_cell_magic("gpumem", "--whatif -o -q", step)
    assert panel.baseline_report.before >= INT8 + INT4
    assert panel.baseline_report.frozen_parameters == INT8 + INT4
    panel.set(batch_size=64)
    assert panel.error is None and panel.report.peak > panel.baseline_report.peak
    assert panel.report.frozen_parameters == INT8 + INT4


def test_torchao_refuses_tinygemm_int4_on_a_t4_as_on_the_card_itself(ip):
    """torchao checks the card's compute capability (tinygemm needs 8.0): on a simulated
    T4 (7.5) the cell fails with torchao's own error, as on a T4."""
    pytest.importorskip("torchao")
    ip.run_line_magic("gpusim", "on --gpu T4")
    result = ip.run_cell(TORCHAO)
    assert isinstance(result.error_in_exec, ValueError)
    assert "compute capability (7, 5)" in str(result.error_in_exec)


def test_torchao_config_through_transformers_from_pretrained(ip, tmp_path):
    pytest.importorskip("torchao")
    _save_small_llama(tmp_path)
    ip.run_line_magic("gpusim", "on --gpu T4")
    result = ip.run_cell(f"""
import torch
from transformers import AutoModelForCausalLM, TorchAoConfig
from torchao.quantization import Int8WeightOnlyConfig
model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, dtype=torch.bfloat16, device_map="cuda",
                                             quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
ids = torch.randint(0, 8000, (4, 128), device="cuda")
""")
    assert result.error_in_exec is None
    r = ip.run_cell_magic("gpumem", "-o -q --no-chart",
                          "out = model.generate(ids, max_new_tokens=8, do_sample=False)")
    # int8 rows (values, fp32 scale, int8 zero point): q k v o 512 x 512, gate up 1376 x 512,
    # down 512 x 1376; transformers leaves lm_head in bf16
    def int8(rows, cols):
        return rnd(rows * cols) + rnd(rows * 4) + rnd(rows)
    frozen = 2 * (4 * int8(512, 512) + 2 * int8(1376, 512) + int8(512, 1376))  # 6,378,496 B
    # embeddings, lm_head and the five RMSNorms: bf16, and still trainable
    trainable = 2 * rnd(8000 * 512 * 2) + 5 * rnd(512 * 2)                      # 16,389,120 B
    assert r.error is None and r.frozen_parameters == frozen
    assert r.breakdown["parameters"] == frozen + trainable
    assert r.breakdown["kv_cache"] > 0


PEFT_METHODS = {
    "lora+dora": "peft.LoraConfig(r=8, target_modules=['q_proj', 'v_proj'], use_dora=True)",
    "ia3": "peft.IA3Config(target_modules=['k_proj', 'v_proj', 'down_proj'], "
           "feedforward_modules=['down_proj'])",
    "prefix": "peft.PrefixTuningConfig(task_type='CAUSAL_LM', num_virtual_tokens=16)",
    # adds its adapter when torch.rand(1) > module_dropout: a draw the simulation makes for real
    "loha": "peft.LoHaConfig(r=8, target_modules=['q_proj', 'v_proj'])",
}


@pytest.mark.parametrize("method", sorted(PEFT_METHODS))
def test_peft_methods_train_their_adapters_only(ip, method):
    """Each method's first step leaves exactly AdamW's two moments of the trainable
    parameters on the card (besides the first matmuls' cuBLAS workspaces and the loss):
    the adapters got gradients, the frozen base none."""
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell(f"""
import torch, peft
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4)
model = peft.get_peft_model(LlamaForCausalLM(cfg), {PEFT_METHODS[method]}).cuda()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
ids = torch.randint(0, 8000, (2, 64), device="cuda")
""")
    r = ip.run_cell_magic("gpumem", "-o -q --no-chart", STEP)
    trainable = r.breakdown["parameters"] - r.frozen_parameters
    assert r.error is None and 0 < trainable < r.frozen_parameters
    assert r.after - r.before == 2 * trainable + 2 * CUBLAS + 512
