"""DeepSpeed's ZeRO stages 1, 2 and 3 on simulated ranks: ``python -m memmagic run
--world-size 2 train.py`` runs a script that calls ``deepspeed.initialize`` unchanged
(DeepSpeed installed without its CUDA ops), and each stage's model states per GPU match
hand arithmetic, beside what DeepSpeed's own estimators say (they count the model states
only: no activations, no gradient buckets, no cuBLAS workspaces).

Each run is a process of its own: DeepSpeed's import picks an accelerator and sets up its
own logging for the life of the process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from test_cli_jobs import LLAMA, TRAINER_MODEL

pytest.importorskip("deepspeed")

MiB = 2**20
D, BLOCKS = 1024, 4
P = BLOCKS * (2 * D * 4 * D + 4 * D + D)  # parameters: 4 blocks of Linear(D, 4D), Linear(4D, D)

# a DeepSpeed training script as its tutorials write one: bf16, AdamW, ZeRO stage from the
# command line; it prints DeepSpeed's own estimate of the model states per GPU
ZERO = textwrap.dedent(f'''
    import argparse, json
    import torch
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=1)
    args = p.parse_args()
    model = torch.nn.Sequential(*[torch.nn.Sequential(
        torch.nn.Linear({D}, {4 * D}), torch.nn.ReLU(), torch.nn.Linear({4 * D}, {D}))
        for _ in range({BLOCKS})])
    config = {{"train_micro_batch_size_per_gpu": 8, "bf16": {{"enabled": True}},
              "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-4, "torch_adam": True}}}},
              "zero_optimization": {{"stage": args.stage}}}}
    n = sum(p.numel() for p in model.parameters())  # ZeRO-3 empties them: counted before
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    for step in range(2):
        x = torch.randn(8, {D}, device=engine.device, dtype=torch.bfloat16)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    if args.stage < 3:
        _, gpu = estimate_zero2_model_states_mem_needs(n, num_gpus_per_node=2, cpu_offload=False)
    else:
        largest = {4 * D * D + 4 * D}
        _, gpu, _ = estimate_zero3_model_states_mem_needs(
            n, largest, num_gpus_per_node=2, cpu_offload=False, cpu_offload_params=False)
    print("ESTIMATE", json.dumps(gpu))
''')


def _zero(tmp_path, stage: int) -> tuple[dict, int]:
    script = tmp_path / "zero.py"
    script.write_text(ZERO)
    out = tmp_path / f"zero{stage}.json"
    done = subprocess.run([sys.executable, "-m", "memmagic", "run", "--gpu", "H100",
                           "--world-size", "2", "--json", str(out), str(script),
                           "--stage", str(stage)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    estimate = next(int(json.loads(line.split(" ", 1)[1])) for line in done.stdout.splitlines()
                    if line.startswith("ESTIMATE "))
    return json.loads(out.read_text()), estimate


@pytest.fixture(scope="module")
def zero(tmp_path_factory):
    return {stage: _zero(tmp_path_factory.mktemp(f"zero{stage}"), stage) for stage in (1, 2, 3)}


def test_each_zero_stage_holds_the_model_states_of_one_gpu_by_hand(zero):
    """bf16 weights (2 B a parameter), a fp32 master copy and AdamW's two fp32 moments
    (12 B a parameter) sharded over the 2 GPUs; stage 3 shards the bf16 weights too."""
    for stage, (report, _) in zero.items():
        moments = report["breakdown"]["optimizer_state"]
        assert moments == pytest.approx(8 * P / 2, rel=1e-3), stage
    one, two, three = (zero[s][0] for s in (1, 2, 3))
    # at the end of the run: the whole bf16 model and the master shard (stages 1, 2)
    for report in (one, two):
        assert report["breakdown"]["parameters"] == pytest.approx(2 * P + 4 * P / 2, rel=1e-3)
    # stage 3 gathers the layers it runs (here all four: its prefetch bucket, 5e7 elements,
    # holds the whole model), which are parameters while gathered: at the peak at most the
    # whole bf16 model plus the master shard
    assert three["breakdown"]["parameters"] <= 2 * P + 4 * P / 2


def test_the_simulated_peak_shows_what_deepspeeds_estimate_leaves_out(zero):
    """DeepSpeed's estimators count the model states; a rank also holds the gradient
    bucket (``reduce_bucket_size``, 5e8 elements by default: 954 MiB in bf16), the
    activations and cuBLAS's workspaces, so the simulated peak is above the estimate by
    at least the bucket."""
    bucket = int(5e8) * 2
    for stage, (report, estimate) in zero.items():
        # ZeRO-1/2: 2 B of bf16 weights + 18 B / 2 GPUs; ZeRO-3: the largest layer in fp32
        # + 18 B / 2 GPUs (DeepSpeed's formulas)
        by_formula = 2 * P + 9 * P if stage < 3 else 4 * (4 * D * D + 4 * D) + 9 * P
        assert estimate == by_formula, stage
        assert report["peak"] > estimate + 0.9 * bucket, (stage, report["peak"], estimate)
        assert report["breakdown"]["other"] >= 0.9 * bucket, stage


TRAINER = TRAINER_MODEL + textwrap.dedent('''
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, max_steps=2,
                             report_to=[], save_strategy="no", bf16=True, deepspeed=ds)
    Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=Tokens()).train()
''')


def test_a_transformers_trainer_with_deepspeed_zero2_runs_unchanged_on_two_ranks(tmp_path):
    """transformers' Trainer drives DeepSpeed through accelerate (``deepspeed=`` a config):
    AdamW's two fp32 moments of each parameter, over 2 GPUs, by hand."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**LLAMA)).parameters())
    script = tmp_path / "train.py"
    script.write_text(TRAINER)
    out = tmp_path / "trainer.json"
    done = subprocess.run([sys.executable, "-m", "memmagic", "run", "--gpu", "H100",
                           "--world-size", "2", "--json", str(out), str(script)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["breakdown"]["optimizer_state"] == pytest.approx(8 * n / 2, rel=2e-3)
