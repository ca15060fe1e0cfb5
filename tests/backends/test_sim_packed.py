"""Packed sequences on the simulated GPU (memmagic/backends/sim/packed.py): packing and
unpacking give what torch gives on real tensors, an RNN on a packed batch runs as cuDNN's
(sized as its padded batch, and the note says so), and lengths the simulation cannot know
stop the cell with its one-line error."""

from __future__ import annotations

import pytest
import torch

from memmagic.backends.sim import SimBackend
from memmagic.backends.sim.cudnn import rnn_reserve
from memmagic.backends.sim.errors import SimulationUnsupported

# a batch of four sentences padded to 10 tokens, packed, unpacked to 12 steps
PACKING = """
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
features = torch.randn(4, 10, 6, device=DEVICE, requires_grad=True)
lengths = torch.tensor(LENGTHS)
packed = pack_padded_sequence(features, lengths, batch_first=True, enforce_sorted=SORTED)
padded, back = pad_packed_sequence(packed, batch_first=True, total_length=12)
padded.sum().backward()
seen = (tuple(packed.data.shape), packed.batch_sizes.tolist(), str(packed.batch_sizes.device),
        None if packed.sorted_indices is None else packed.sorted_indices.tolist(),
        tuple(padded.shape), padded.stride(), back.tolist(), str(back.device),
        tuple(features.grad.shape))
"""


def _cell(device: str, lengths: list[int], enforce_sorted: bool) -> str:
    return (PACKING.replace("DEVICE", repr(device)).replace("LENGTHS", repr(lengths))
            .replace("SORTED", repr(enforce_sorted)))


@pytest.mark.parametrize("lengths,enforce_sorted", [([10, 7, 7, 2], True), ([3, 10, 1, 6], False)])
def test_packing_gives_what_torch_gives(lengths, enforce_sorted):
    real: dict = {}
    exec(_cell("cpu", lengths, enforce_sorted), real)
    out = SimBackend(gpu="T4").execute(
        lambda ns: (exec(_cell("cuda", lengths, enforce_sorted), ns), ns["seen"])[1], {})
    assert out.error is None, out.error
    want, got = list(real["seen"]), list(out.value)
    want[2] = want[7] = "cpu"  # batch sizes and lengths stay on the CPU, on a GPU too
    if not enforce_sorted:
        # the lengths unpacked in the caller's order go through torch's invert_permutation (a
        # scatter into uninitialized memory on the GPU), whose values the simulation does
        # not follow: they read as placeholders
        assert all(str(v).endswith("(simulated)") for v in got[6])
        got[6] = want[6]
    assert got == want
    # the packed rows (the sum of the lengths) and the padded batch were allocated
    sizes = {e.get("size") for e in out.report.trace.allocator_log.entries if e["action"] == "alloc"}
    assert {sum(lengths) * 6 * 4, 4 * 12 * 6 * 4} <= sizes


@pytest.mark.parametrize("lengths", [[3, 10, 1, 6], [10, 7, 7], [10, 7, 7, 0]],
                         ids=["unsorted", "not one a sample", "empty sample"])
def test_bad_lengths_raise_torchs_error(lengths):
    out = SimBackend(gpu="T4").execute(lambda ns: exec(_cell("cuda", lengths, True), ns), {})
    with pytest.raises(RuntimeError) as real:
        exec(_cell("cpu", lengths, True), {})
    assert isinstance(out.error, RuntimeError) and str(real.value) in str(out.error)


def test_lengths_from_data_stop_the_cell_in_one_line():
    src = _cell("cuda", [10, 7, 7, 2], True).replace(
        "lengths = torch.tensor([10, 7, 7, 2])", "lengths = (features.sum(-1) > -1e9).sum(1).cpu()")
    out = SimBackend(gpu="T4").execute(lambda ns: exec(src, ns), {})
    assert isinstance(out.error, SimulationUnsupported)
    assert "depends on tensor values" in str(out.error) and "\n" not in str(out.error)


def test_an_rnn_on_a_packed_batch_runs_as_cudnn_sized_as_its_padded_batch():
    src = """
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
gru = torch.nn.GRU(32, 64, num_layers=2, bidirectional=True, batch_first=True).cuda()
x = torch.randn(8, 20, 32, device="cuda")
packed = pack_padded_sequence(x, [20, 18, 15, 15, 9, 6, 3, 1], batch_first=True)
out, h = gru(packed)
padded, _ = pad_packed_sequence(out, batch_first=True)
padded.mean().backward()
"""
    out = SimBackend(gpu="T4").execute(lambda ns: exec(src, ns), {})
    assert out.error is None, out.error
    allocs = [e.get("size") for e in out.report.trace.allocator_log.entries if e["action"] == "alloc"]
    assert rnn_reserve("GRU", 2, True, 20, 8, 64, 4) in allocs  # 20 steps of a batch of 8
    assert 87 * 2 * 64 * 4 in allocs  # the output's packed rows
    note = next(n for n in out.report.notes if "ran as cuDNN's" in n)
    assert "1 call on packed sequences" in note and "not measured" in note
    assert not any("CPU kernels' memory" in n for n in out.report.notes)
    assert torch.backends.cudnn.enabled
