"""Knobs as data, settings, and the Applier that installs and takes away what they change."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memmagic import zoo
from memmagic.knobs import KNOBS, Applier, KnobError, Setting, find_blocks, make_optimizer

from conftest import global_state


def test_a_setting_keeps_only_what_differs_from_the_cell_as_written():
    s = Setting(amp="off", checkpointing=False, batch_size=32)
    assert s.changed() == {"batch_size": 32}
    assert s.amp == "off" and s.accum_steps == 1 and s.optimizer is None
    assert s == Setting(batch_size=32) and hash(s) == hash(Setting(batch_size=32))
    assert Setting().label() == "as written"


def test_setting_values_are_normalised_and_checked():
    s = Setting(checkpointing="on", batch_size="64", amp="FP16", gpu="t4")
    assert (s.checkpointing, s.batch_size, s.amp, s.gpu) == (True, 64, "fp16", "T4")
    with pytest.raises(KnobError, match="off, fp16, bf16"):
        Setting(amp="fp8")
    with pytest.raises(KnobError, match="whole number"):
        Setting(batch_size=2.5)
    with pytest.raises(KnobError, match="between 1 and"):
        Setting(accum_steps=0)
    with pytest.raises(KnobError, match="T4"):
        Setting(gpu="H900")
    with pytest.raises(TypeError, match="unknown knob 'ampp'"):
        Setting(ampp="fp16")
    with pytest.raises(AttributeError, match="immutable"):
        s.amp = "bf16"


def test_label_says_effective_and_micro_batch():
    s = Setting(batch_size=64, accum_steps=4, amp="bf16", checkpointing=True)
    assert s.micro_batch == 16
    assert s.label() == "batch 64 (4 x 16), amp bf16, ckpt"
    with pytest.raises(KnobError, match="multiple of 4"):
        Setting(batch_size=30, accum_steps=4).check_batch()


def test_every_knob_says_how_it_is_applied_and_what_it_needs():
    for k in KNOBS.values():
        assert k.how and k.needs in {"model", "batch", "seq", "generate", "accum", "blocks", "backward",
                                      "optimizer", "inplace", "sim"}
        assert Setting(**{k.name: k.default}) == Setting()


def test_find_blocks_takes_the_repeated_blocks_not_their_layers():
    model, _ = zoo.build("transformer", "meta")
    blocks = find_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["TransformerBlock"] * 2
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))) == []
    assert [type(b).__name__ for b in find_blocks(model, "SDPAttention")] == ["SDPAttention"] * 2


@pytest.mark.parametrize("name, cls", [("sgd", "SGD"), ("sgd-momentum", "SGD"), ("adam", "Adam"),
                                       ("adamw", "AdamW"), ("adafactor", "Adafactor")])
def test_make_optimizer(name, cls):
    opt = make_optimizer(name, nn.Linear(2, 2).parameters(), lr=0.5)
    assert type(opt).__name__ == cls and opt.param_groups[0]["lr"] == 0.5


def _apply_all(a: Applier) -> None:
    s = Setting(amp="fp16", checkpointing=True, weights_dtype="bf16", grad_mode="no_grad",
                offload=True, optimizer="sgd", inplace=True)
    for k in KNOBS.values():
        if k.apply is not None:
            k.apply(a, getattr(s, k.name))
    a.install()


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_the_applier_restores_everything_after_an_exception(exc):
    before = global_state()
    opt_step = torch.optim.AdamW.step
    backward = torch.autograd.backward
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    a = Applier("cpu")
    with pytest.raises(exc):
        try:
            _apply_all(a)
            model(torch.randn(2, 4))  # autocast entered, model converted, inplace set
            assert torch.is_autocast_enabled("cpu")
            raise exc("boom")
        finally:
            a.close()
    assert global_state() == before
    assert torch.optim.AdamW.step is opt_step and torch.autograd.backward is backward
    assert torch.optim.Adam is not None and torch.optim.Adam.__name__ == "Adam"
    assert model[1].inplace is False and model.training
    a.close()  # idempotent


def test_models_called_blocks_and_optimizers_are_recorded():
    a = Applier("cpu")
    a.install()
    try:
        model, (x, y) = zoo.build("mlp", "cpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.loss(x, y).backward()
        opt.step()
    finally:
        a.close()
    assert a.models == ["ZooModel"] and a.blocks == 3 and a.optimizers_built == ["SGD"]
    assert a.backward_calls == 1 and a.steps_run == 1
