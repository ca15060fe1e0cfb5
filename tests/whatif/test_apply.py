"""The Applier that installs and takes away what the knobs change, and the helpers the
knobs' apply functions use."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memmagic import zoo
from memmagic.whatif.apply import Applier, KnobError, find_blocks, make_optimizer
from memmagic.whatif.knobs import KNOBS, Setting

from conftest import global_state


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


def test_make_optimizer_takes_the_optimizer_knobs_names():
    assert type(make_optimizer("AdamW", nn.Linear(2, 2).parameters())).__name__ == "AdamW"
    with pytest.raises(KnobError, match="optimizer must be one of sgd, sgd-momentum, adam, "
                                        "adamw, adafactor, not 'lion'"):
        make_optimizer("lion", nn.Linear(2, 2).parameters())
    assert KNOBS["optimizer"].choices == ("sgd", "sgd-momentum", "adam", "adamw", "adafactor")


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
