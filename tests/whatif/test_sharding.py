"""FSDP2 over N simulated GPUs: rank 0's memory against the arithmetic of sharding."""

from __future__ import annotations

import torch
import torch.distributed as dist

from memmagic.core import tracking
from memmagic.whatif import sharding
from memmagic.backends.sim.tracker import SimTracker

# four 512x512 weights without bias: 1 MiB each, so every shard is a multiple of the
# simulated allocator's 512-byte rounding for 2 and 4 ranks (no padding, no rounding)
STEP = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(512, 512, bias=False) for _ in range(4))
    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return x

model = Net().cuda()
opt = torch.optim.Adam(model.parameters())
x = torch.randn(8, 512, device="cuda")
model(x).sum().backward()
opt.step()
"""
P = 4 * 512 * 512 * 4  # parameter bytes


def _at_end(report):
    trace = report.trace
    return trace.breakdown_at(len(trace.events) - 1)


def test_rank_memory_is_the_arithmetic_of_sharded_parameters_gradients_and_adam_state():
    for n in (2, 4):
        r = sharding.simulate_fsdp(STEP, world_size=n)
        assert r.report is not None, r.reason
        assert r.sharded == ("model.blocks.0", "model.blocks.1", "model.blocks.2",
                             "model.blocks.3", "model")
        end = _at_end(r.report)
        assert end["parameters"] == P // n
        assert end["gradients"] == P // n
        assert end["optimizer_state"] == 2 * P // n  # exp_avg, exp_avg_sq (steps on the host)


def test_zero_stages_shard_what_each_stage_shards_by_torchs_own_machinery():
    """ZeRO-1 (torch's ZeroRedundancyOptimizer): the whole model and its gradients on every
    rank, Adam's two moments of rank 0's partition only (two of the four 1 MiB weights over
    2 ranks, one over 4). ZeRO-2 (FSDP2, reshard_after_forward=False) ends a step as ZeRO-3
    does, shards of everything, but keeps every gathered weight from forward to backward."""
    for n in (2, 4):
        r1 = sharding.simulate_zero(STEP, world_size=n, stage=1)
        assert r1.report is not None, r1.reason
        assert r1.sharded == ("Adam",) and r1.label().startswith(f"ZeRO-1 over {n} GPUs")
        end = _at_end(r1.report)
        assert (end["parameters"], end["gradients"], end["optimizer_state"]) == (P, P, 2 * P // n)
        r2 = sharding.simulate_zero(STEP, world_size=n, stage=2)
        end = _at_end(r2.report)
        assert (end["parameters"], end["gradients"], end["optimizer_state"]) == (P // n, P // n,
                                                                                2 * P // n)
    # after a forward only: ZeRO-2 holds every gathered weight, ZeRO-3 none
    forward = STEP.replace("model(x).sum().backward()\nopt.step()", "y = model(x).sum()")
    held = {stage: _at_end(sharding.simulate_zero(forward, world_size=4, stage=stage).report)
            for stage in (2, 3)}
    assert held[2]["parameters"] == P // 4 + P
    assert held[3]["parameters"] == P // 4


def test_zero_one_steps_through_a_scheduler_and_a_cell_made_optimizer_stays_usable():
    """The cell's optimizer object stays the cell's (its param_groups all the parameters,
    an LR scheduler's rate reaching the partition's step); stage 4 is refused."""
    import pytest

    cell = STEP.replace("opt.step()", """
sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
opt.step(); sched.step()
opt.zero_grad(set_to_none=True)
model(x).sum().backward(); opt.step()
groups = len(opt.param_groups[0]["params"]), opt.param_groups[0]["lr"]
""")
    r = sharding.simulate_zero(cell, world_size=2, stage=1)
    assert r.report is not None, r.reason
    assert _at_end(r.report)["optimizer_state"] == P
    with pytest.raises(ValueError, match="stages 1, 2 and 3"):
        sharding.simulate_zero(STEP, world_size=2, stage=4)
    assert not dist.is_initialized()


def test_torch_distributed_optim_imports_in_a_simulated_cell():
    """torch.distributed.optim scripts functional optimizers when imported: TorchScript
    compiles them against the simulator's foreach default, which says its types as torch's."""
    import subprocess
    import sys

    code = ("from memmagic.backends.sim import SimBackend\n"
            "out = SimBackend(gpu='T4').execute(lambda ns: exec("
            "'from torch.distributed.optim import ZeroRedundancyOptimizer', ns), {})\n"
            "print(out.report.error)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stdout + done.stderr


def test_the_peak_counts_the_all_gathered_block_not_the_whole_model():
    r2 = sharding.simulate_fsdp(STEP, world_size=2)
    r4 = sharding.simulate_fsdp(STEP, world_size=4)
    # sharding over more GPUs lowers rank 0's peak by (1/2 - 1/4) of params+grads+state at least
    assert r4.peak < r2.peak
    assert r2.peak - r4.peak >= (P // 2 - P // 4) * 3
    # parameters at the peak: the shards plus at most two all-gathered blocks, never the model
    block = P // 4
    params_at_peak = r4.report.breakdown["parameters"]
    assert P // 4 <= params_at_peak <= P // 4 + 2 * block


def test_a_cell_without_an_optimizer_says_why():
    r = sharding.simulate_fsdp("import torch\nx = torch.ones(4, device='cuda')\n", world_size=2)
    assert r.report is None and r.peak is None
    assert "optimizer" in r.reason and "FSDP2" in r.reason
    assert "not simulated" in str(r)


def test_world_size_one_is_refused():
    import pytest

    with pytest.raises(ValueError, match="2 or more"):
        sharding.simulate_fsdp(STEP, world_size=1)


def test_everything_installed_is_restored_also_after_the_cell_fails(clean_state):
    methods = {n: tracking.StorageTracker.__dict__[n] for n in ("track", "note", "serial_of", "recheck_size")}
    pool = SimTracker.__dict__["pool_from_inputs"]
    init = torch.optim.Optimizer.__dict__["__init__"]
    r = sharding.simulate_fsdp(STEP + "raise ValueError('boom')\n", world_size=2)
    assert r.report is None and "boom" in r.reason
    assert {n: tracking.StorageTracker.__dict__[n] for n in methods} == methods
    assert SimTracker.__dict__["pool_from_inputs"] is pool
    assert torch.optim.Optimizer.__dict__["__init__"] is init
    assert not dist.is_initialized()


def test_the_namespace_given_is_not_changed():
    ns = {"keep": 1}
    sharding.simulate_fsdp(STEP, ns, world_size=2)
    assert ns == {"keep": 1}


# -- the cell's own parallelism: --world-size (issue 26, item 3) -------------------------------
MLP = """
import torch
from torch import nn

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(1024, 4096, bias=False)
        self.w2 = nn.Linear(4096, 1024, bias=False)
    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))

model = nn.Sequential(MLP(), MLP()).cuda()
"""
W = 2 * 2 * 4096 * 1024 * 4  # the two MLPs' four fp32 weights: 64 MiB
TP = """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
mesh = init_device_mesh("cuda", (4,))
for m in model:
    parallelize_module(m, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(8, 1024, device="cuda")
y = model(x)
shapes = [tuple(y.shape), tuple(model[0].w1.weight.to_local().shape)]
y.sum().backward()
opt.step()
"""


def test_tensor_parallel_holds_a_quarter_of_the_weights_on_each_of_four_gpus(ip, clean_state):
    """ColwiseParallel shards w1 by its output rows, RowwiseParallel w2 by its input
    columns: each rank holds 1/4 of every weight, its gradient and AdamW's two moments;
    the MLP's output is replicated (RowwiseParallel all-reduces it)."""
    ip.run_line_magic("gpusim", "on --gpu A100-80GB")
    ip.run_cell(MLP)
    r = ip.run_cell_magic("gpumem", "--world-size 4 -o -q --no-chart", TP + "\nseen = shapes")
    assert r.error is None
    end = _at_end(r)
    assert end["parameters"] == W // 4                                  # 16,777,216 B
    assert end["gradients"] == W // 4
    assert end["optimizer_state"] == 2 * W // 4  # exp_avg, exp_avg_sq (steps on the host)
    assert r.breakdown["parameters"] == W // 4   # at the peak too: never the whole model
    assert "rank 0 of 4 GPUs" in r.device and any("NCCL" in n for n in r.notes)
    # the cell ran on a copy of the notebook's card: its names are as they were
    ip.run_cell("kind = type(model[0].w1.weight).__name__\nheld = torch.cuda.memory_allocated()")
    assert ip.user_ns["kind"] == "FakeTensor" and ip.user_ns["held"] == W
    assert "seen" not in ip.user_ns and not dist.is_initialized()


def test_tensor_parallel_activations_are_sharded_between_the_layers_and_replicated_after():
    """Rank 0 holds a quarter of w1's rows (1024 of 4096) and the output [8, 1024] whole
    (RowwiseParallel all-reduces it); the pipeline's run, without a notebook."""
    from memmagic.pipeline import CellRequest, run_cell
    from tests.backends.test_sim import Recorder

    seen: dict = {}
    hook = ("\nmodel[0].w1.register_forward_hook("
            "lambda m, i, o: seen.__setitem__('hidden', tuple(o.shape)))\n")
    src = MLP + TP.replace("y = model(x)", hook + "y = model(x)") + "\nseen['shapes'] = shapes"
    res = run_cell(CellRequest(src, {"seen": Recorder(seen)}, backend="sim", gpu="A100-80GB",
                               world_size=4))
    assert res.error is None
    assert seen["hidden"] == (8, 4096 // 4)                # between the layers: split
    assert seen["shapes"] == [(8, 1024), (1024, 1024)]     # the output whole, w1's rows split
    assert res.report.device == "simulated cuda:0 (A100-80GB, rank 0 of 4 GPUs)"
    assert not dist.is_initialized()


def test_2d_parallel_fsdp2_over_tensor_parallel_shards_by_both(ip, clean_state):
    """A (2, 2) mesh: tensor parallel over "tp", FSDP2 over "dp" (each MLP, then the
    model): every weight is split 4 ways, by TP and then by FSDP2."""
    ip.run_line_magic("gpusim", "on --gpu A100-80GB")
    ip.run_cell(MLP)
    r = ip.run_cell_magic("gpumem", "--world-size 4 -o -q --no-chart", """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
from torch.distributed.fsdp import fully_shard
mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
for m in model:
    parallelize_module(m, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(8, 1024, device="cuda")).sum().backward()
opt.step()
""")
    assert r.error is None
    end = _at_end(r)
    assert end["parameters"] == W // 4 and end["gradients"] == W // 4
    assert end["optimizer_state"] == 2 * W // 4


def test_fsdp2_on_any_module_the_cell_names(ip, clean_state):
    """fully_shard on the cell's own choice of modules (here the whole Sequential, no
    ModuleList): each of 8 ranks keeps 1/8 of the parameters, gradients and moments."""
    ip.run_line_magic("gpusim", "on --gpu A100-80GB")
    ip.run_cell(MLP)
    r = ip.run_cell_magic("gpumem", "--world-size 8 -o -q --no-chart", """
from torch.distributed.fsdp import fully_shard
fully_shard(model)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(8, 1024, device="cuda")).sum().backward()
opt.step()
""")
    assert r.error is None
    end = _at_end(r)
    assert end["parameters"] == W // 8 and end["gradients"] == W // 8
    assert end["optimizer_state"] == 2 * W // 8
    # during forward and backward the whole model was gathered once (one FSDP2 unit)
    assert r.breakdown["parameters"] <= W // 8 + W


def test_world_size_needs_the_simulated_gpu_and_two_gpus_or_more(ip):
    from IPython.core.error import UsageError
    import pytest

    with pytest.raises(UsageError, match="add --backend sim"):
        ip.run_cell_magic("gpumem", "--backend cpu --world-size 4 -q", "x = 1")
    with pytest.raises(UsageError, match="2 or more"):
        ip.run_cell_magic("gpumem", "--world-size 1 -q", "x = 1")
    with pytest.raises(UsageError, match="8 GPUs do not split into nodes of 3"):
        ip.run_cell_magic("gpumem", "--world-size 8 --gpus-per-node 3 -q", "x = 1")
    # nodes of 4: rank 5 is cuda:1 of the second node, which has 4 GPUs
    r = ip.run_cell_magic("gpumem", "--world-size 8 --gpus-per-node 4 --rank 5 -o -q --no-chart",
                          "import torch\nx = torch.ones(torch.cuda.device_count(), 1024, device='cuda')")
    assert r.device.startswith("simulated cuda:1 ") and r.peak == 4 * 1024 * 4
    assert not dist.is_initialized()


def test_reshard_after_forward_false_keeps_the_gathered_parameters_like_zero2(ip):
    """FSDP2's ``reshard_after_forward=False`` keeps each unit's all-gathered parameters
    from forward to backward (ZeRO-2-like), the default frees them after forward (ZeRO-3):
    the peak holds more parameters."""
    ip.run_line_magic("gpusim", "on --gpu A100-80GB")
    ip.run_cell(MLP)
    step = """
from torch.distributed.fsdp import fully_shard
for m in model:
    fully_shard(m, reshard_after_forward={})
fully_shard(model, reshard_after_forward={})
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(8, 1024, device="cuda")).sum().backward()
opt.step()
"""
    zero3 = ip.run_cell_magic("gpumem", "--world-size 4 -o -q --no-chart", step.format(True, True))
    zero2 = ip.run_cell_magic("gpumem", "--world-size 4 -o -q --no-chart", step.format(False, False))
    assert zero3.error is None and zero2.error is None
    # at the end both hold their shards only
    assert _at_end(zero3)["parameters"] == _at_end(zero2)["parameters"] == W // 4
    # ZeRO-2-like: both MLPs' gathered weights (W) stay from forward into backward
    assert zero2.breakdown["parameters"] >= W // 4 + W
    assert zero3.breakdown["parameters"] < zero2.breakdown["parameters"]


# -- tensor parallel by a transformers model's own plan (the doctor's rows) ---------------------
LLAMA = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
model = LlamaForCausalLM(cfg).cuda()
"""
LLAMA_STEP = """
opt = torch.optim.AdamW(model.parameters())
ids = torch.randint(0, 8000, (4, 128), device="cuda")
model(input_ids=ids, labels=ids).loss.backward()
opt.step()
"""
# rank 0 of 4 by model.tp_plan: q k v (colwise) and o (rowwise) 512 x 512 / 4, gate up
# (colwise) and down (rowwise) 1376 x 512 / 4, the embedding (rowwise) and lm_head (colwise)
# 8000 x 512 / 4; the five RMSNorms whole (replicated); fp32
TP_PARAMS = (2 * (4 * 512 * 512 + 3 * 1376 * 512) // 4 + 2 * 8000 * 512 // 4 + 5 * 512) * 4


def test_tensor_parallel_by_the_models_own_plan():
    import pytest

    pytest.importorskip("transformers")
    r = sharding.simulate_tp(LLAMA + LLAMA_STEP, world_size=4, gpu="T4")
    assert r.report is not None, r.reason
    assert r.label() == "tensor parallel over 4 GPUs (the model's TP plan)"
    end = _at_end(r.report)
    assert end["parameters"] == TP_PARAMS                                  # 14,526,464 B
    assert end["optimizer_state"] == 2 * TP_PARAMS
    # DTensor's rule for the embedding's backward gives a replicated gradient of the
    # rowwise-sharded embedding (the same Python code on a GPU): 8000 x 512 whole
    assert end["gradients"] == TP_PARAMS - 8000 * 512 + 8000 * 512 * 4
    assert not dist.is_initialized()


def test_a_model_without_a_plan_says_how_to_parallelize_it():
    r = sharding.simulate_tp(STEP, world_size=2)
    assert r.report is None and "carries no tensor-parallel plan" in r.reason
    assert "--world-size" in r.reason and not dist.is_initialized()


def test_the_doctor_adds_tensor_parallel_rows_for_a_model_with_a_plan(ip):
    import pytest

    pytest.importorskip("transformers")
    from memmagic.doctor.ranking import _shard_rows

    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell(LLAMA)
    rows = _shard_rows(LLAMA_STEP, ip.user_ns, (4,), None, None)
    assert [s.label for s in rows][:2] == ["shard over 4 GPUs (FSDP2)",
                                          "tensor parallel over 4 GPUs (the model's TP plan)"]
    assert [s.knobs for s in rows] == [{"fsdp_world_size": 4}, {"tp_world_size": 4},
                                       {"zero2_world_size": 4}, {"zero1_world_size": 4}]
    assert all(s.peak is not None for s in rows), [s.reason for s in rows]
    # a peft model forwards the plan of its base model, whose paths it names: the plan
    # resolves there; LoRA's wrapped projections are no nn.Linear for torch's styles
    ip.run_cell("from peft import LoraConfig, get_peft_model\n"
                "model = get_peft_model(model, LoraConfig(r=4, target_modules=['q_proj']))")
    r = sharding.simulate_tp("opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])",
                             ip.user_ns, world_size=2)
    assert r.report is None and r.reason.startswith(
        "tensor parallelism could not split model: NotImplementedError: ColwiseParallel"), r.reason
    # a plain model (no plan): no tensor-parallel row
    ip.run_cell("model = torch.nn.Linear(64, 64).cuda()")
    rows = _shard_rows("opt = torch.optim.SGD(model.parameters())\nmodel(torch.randn(2, 64, device='cuda')).sum().backward()",
                       ip.user_ns, (2,), None, None)
    assert [next(iter(s.knobs)) for s in rows] == ["fsdp_world_size", "zero2_world_size",
                                                   "zero1_world_size"]


def test_2d_on_a_transformers_model_tp_by_its_plan_and_fsdp2_by_layer():
    """A (2, 2) mesh on the 2-layer Llama: its TP plan over "tp", FSDP2 over "dp" (each
    decoder layer, then the model). Every planned weight is split 4 ways; the five RMSNorms,
    replicated over "tp", are halved by FSDP2; gradients are sharded as the parameters
    (FSDP2 reduce-scatters them, the embedding's too) and AdamW keeps two moments of each."""
    import pytest

    pytest.importorskip("transformers")
    from memmagic.pipeline import CellRequest, run_cell

    res = run_cell(CellRequest(LLAMA + """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from memmagic.whatif.sharding import parallelize
mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
parallelize(model, mesh["tp"])
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
""" + LLAMA_STEP, {}, backend="sim", gpu="T4", world_size=4))
    assert res.error is None, res.error
    end = _at_end(res.report)
    planned = (2 * (4 * 512 * 512 + 3 * 1376 * 512) + 2 * 8000 * 512) // 4 * 4
    assert end["parameters"] == planned + 5 * 512 // 2 * 4                    # 14,521,344 B
    assert end["gradients"] == end["parameters"]
    assert end["optimizer_state"] == 2 * end["parameters"]
    assert not dist.is_initialized()
