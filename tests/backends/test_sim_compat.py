"""The simulated run looks like a GPU run to third-party code and writes no fake data
(memmagic/backends/sim/compat.py, cuda_api.py and kernels.py; issue 14, items 4 and 8)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import typing
import warnings

import pytest
import torch

from memmagic.core import _torch_private as priv
from memmagic.backends.sim import SimulationUnsupported, resolve_target
from memmagic.backends.sim.compat import holds_simulated_tensors, install_compat
from memmagic.backends.sim.cuda_api import DEFAULT_CARD
from memmagic.backends.sim.kernels import NO_BACKEND, NO_KERNEL, choose_sdpa_backend
from memmagic.core.patching import Patches

from test_sim import Recorder, run  # noqa: E402  (the helpers every sim test uses)


class SDPARecorder:
    """Wraps torch.nn.functional.scaled_dot_product_attention and records what each call
    was given: (is_causal, the attn_mask's shape or None)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.orig = None

    def __call__(self, *args, **kwargs):
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
        self.calls.append((bool(causal), None if mask is None else tuple(mask.shape)))
        return self.orig(*args, **kwargs)

    def __deepcopy__(self, memo):
        return self


def compat_state() -> dict:
    import torch.serialization as ser

    state = {"save": torch.save, "ser_save": ser.save, "load": torch.load, "ser_load": ser.load,
             "meta_path": list(sys.meta_path), "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(),
             "sdp_order": priv.sdp_priority_order(),
             "make_subclass": torch.Tensor.__dict__.get("_make_subclass"),
             "hf_async_load": os.environ.get("HF_DEACTIVATE_ASYNC_LOAD"),
             "cuda": {k: getattr(torch.cuda, k) for k in (
                 "Event", "Stream", "CUDAGraph", "graph", "mem_get_info", "get_device_properties")}}
    for mod, names in (("transformers.utils.import_utils", ("is_fake_tensor", "is_tracing")),
                       ("transformers.modeling_utils", ("safe_save_file",)),
                       ("transformers.pytorch_utils", ("storage_ptr",)),
                       ("safetensors.torch", ("save_file", "save_model", "save", "storage_ptr")),
                       ("huggingface_hub.serialization._torch", ("storage_ptr",)),
                       ("bitsandbytes.functional", ("get_paged", "prefetch_tensor", "fill"))):
        m = sys.modules.get(mod)
        if m is not None:
            state[mod] = {n: m.__dict__.get(n) for n in names}
    return state


# -- stand-ins for CUDA classes behave like classes ------------------------------------------
def test_unsupported_cuda_classes_are_classes_until_used():
    seen: dict = {}
    before = compat_state()
    out, _ = run("""
        import typing
        import torch

        def capture(g: torch.cuda.CUDAGraph | None = None) -> torch.cuda.Event | None:
            return None

        class MyGraph(torch.cuda.CUDAGraph):
            pass

        seen["union"] = torch.cuda.CUDAGraph | None
        seen["optional"] = typing.Optional[torch.cuda.Stream]
        seen["hints"] = typing.get_type_hints(capture)
        seen["isinstance"] = (isinstance(3, torch.cuda.Stream), isinstance(None, (torch.cuda.Event, int)))
        seen["subclass"] = issubclass(MyGraph, torch.cuda.CUDAGraph)
        seen["hasattr"] = hasattr(torch.cuda.ExternalStream, "query")
        seen["capturing"] = torch.cuda.is_current_stream_capturing()
        errors = []
        for make in (torch.cuda.CUDAGraph, MyGraph, lambda: torch.cuda.MemPool(),
                     lambda: torch.cuda.ExternalStream.query()):
            try:
                make()
            except Exception as e:
                errors.append((type(e).__name__, str(e)))
        seen["errors"] = errors
        torch.cuda.CUDAGraph()
    """, {"seen": Recorder(seen)})
    assert seen["union"] == typing.Optional[seen["union"].__args__[0]]
    assert seen["hints"]["g"].__args__[0].__name__ == "CUDAGraph"
    assert seen["isinstance"] == (False, False) and seen["subclass"] is True
    assert seen["hasattr"] is False and seen["capturing"] is False
    kinds = [k for k, _ in seen["errors"]]
    assert kinds == ["SimulationUnsupported", "SimulationUnsupported", "SimulationUnsupported",
                     "_UnsupportedAttribute"]
    msgs = [m for _, m in seen["errors"]]
    assert msgs[0].startswith("torch.cuda.CUDAGraph cannot be simulated; ")
    assert msgs[1].startswith("torch.cuda.CUDAGraph cannot be simulated")  # the subclass names its base
    assert msgs[2].startswith("torch.cuda.MemPool cannot be simulated")
    assert msgs[3].startswith("torch.cuda.ExternalStream.query cannot be simulated")
    assert all("\n" not in m for m in msgs)
    # the cell's own last line fails with the one-line error, naming the line
    assert isinstance(out.error, SimulationUnsupported)
    assert "torch.cuda.CUDAGraph cannot be simulated" in str(out.error)
    assert str(out.error).startswith("line 26: ")
    assert compat_state() == before


# -- torch.save / torch.load of simulated tensors ---------------------------------------------
def test_torch_save_of_simulated_tensors_writes_nothing(tmp_path):
    seen: dict = {}
    ckpt, plain, whole = tmp_path / "ckpt.pt", tmp_path / "plain.pt", tmp_path / "model.pt"
    before = compat_state()
    out, _ = run(f"""
        import io
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2)).cuda()
        model[1].weight = torch.nn.Parameter(model[0].weight.detach()[:2])  # two names, one storage
        torch.save(model.state_dict(), {str(ckpt)!r})
        torch.save({{"epoch": 3, "lr": [0.1, 0.01], "name": "run"}}, {str(plain)!r})
        seen["plain"] = torch.load({str(plain)!r})
        before_load = torch.cuda.memory_allocated()
        sd = torch.load({str(ckpt)!r})
        seen["loaded_bytes"] = torch.cuda.memory_allocated() - before_load
        seen["sd"] = {{k: (tuple(v.shape), str(v.device), v.dtype) for k, v in sd.items()}}
        seen["shared"] = sd["0.weight"].untyped_storage().nbytes() == sd["1.weight"].untyped_storage().nbytes()
        seen["metadata"] = hasattr(sd, "_metadata")
        model.load_state_dict(sd)
        cpu = torch.load({str(ckpt)!r}, map_location="cpu")
        seen["cpu"] = sorted({{str(v.device) for v in cpu.values()}})
        buf = io.BytesIO()
        torch.save({{"w": model[0].weight, "step": 7}}, buf)
        seen["buffer_empty"] = buf.getvalue() == b""
        buf.seek(0)
        got = torch.load(buf)
        seen["buffer"] = (tuple(got["w"].shape), got["step"], isinstance(got["w"], torch.nn.Parameter))
        torch.save(model, {str(whole)!r})
        try:
            torch.load({str(whole)!r})
        except Exception as e:
            seen["whole"] = (type(e).__name__, str(e))
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert not ckpt.exists() and not whole.exists()
    assert plain.exists() and seen["plain"] == {"epoch": 3, "lr": [0.1, 0.01], "name": "run"}
    assert seen["sd"] == {"0.weight": ((64, 64), "cuda:0", torch.float32),
                          "0.bias": ((64,), "cuda:0", torch.float32),
                          "1.weight": ((2, 64), "cuda:0", torch.float32),
                          "1.bias": ((2,), "cuda:0", torch.float32)}
    # one allocation per storage, as a load makes: the shared weight once (16 KiB) + biases
    assert seen["loaded_bytes"] == 64 * 64 * 4 + 512 + 512
    assert seen["shared"] and seen["metadata"] and seen["cpu"] == ["cpu"]
    assert seen["buffer_empty"] and seen["buffer"] == ((64, 64), 7, True)
    kind, msg = seen["whole"]
    assert kind == "SimulationUnsupported" and "cannot rebuild a Sequential" in msg
    notes = out.report.notes
    saves = [n for n in notes if n.startswith("torch.save")]
    assert saves == [f"torch.save skipped 3 times ({str(ckpt)!r}, <BytesIO>, {str(whole)!r}): "
                     "the object holds simulated tensors (no data); nothing was written"]
    assert f"torch.load({str(ckpt)!r}) gave simulated tensors like those its skipped " \
           "torch.save held (nothing was read)" in notes
    assert compat_state() == before


def test_one_skipped_save_is_named_in_the_note(tmp_path):
    path = tmp_path / "ckpt.pt"
    out, _ = run(f"""
        import torch
        torch.save(torch.nn.Linear(4, 4).cuda().state_dict(), {str(path)!r})
    """)
    assert out.error is None, out.error
    assert not path.exists()
    assert (f"torch.save({str(path)!r}) skipped: the object holds simulated tensors (no data); "
            "nothing was written") in out.report.notes


def test_holds_simulated_tensors():
    mode = priv.new_fake_mode()
    fake = priv.fake_copy(mode, torch.ones(3))
    assert holds_simulated_tensors({"a": [1, (2, fake)]})
    assert holds_simulated_tensors(torch.nn.Linear(2, 2).to_empty(device="cpu")) is False
    m = torch.nn.Linear(2, 2)
    m.weight = torch.nn.Parameter(priv.fake_copy(mode, m.weight))
    assert holds_simulated_tensors(m)
    assert not holds_simulated_tensors({"real": torch.ones(3), "n": 1})
    assert not holds_simulated_tensors(lambda: fake)  # unpicklable: torch.save raises its own error


def test_saves_outside_a_run_are_untouched(tmp_path):
    path = tmp_path / "real.pt"
    patches, notes = Patches(), []
    install_compat(patches, notes)
    patches.restore()
    torch.save({"w": torch.arange(4)}, path)
    assert torch.equal(torch.load(path)["w"], torch.arange(4)) and notes == []


# -- torch.cuda.mem_get_info ------------------------------------------------------------------
def test_mem_get_info_answers_for_the_target_card():
    seen: dict = {}
    out, _ = run("""
        import torch
        x = torch.empty(1 << 20, device="cuda")
        seen["info"] = torch.cuda.mem_get_info()
        seen["memory_info"] = torch.cuda.memory.mem_get_info(0)
        seen["reserved"] = torch.cuda.memory_reserved()
        seen["total"] = torch.cuda.get_device_properties(0).total_memory
    """, {"seen": Recorder(seen)}, gpu="T4")
    assert out.error is None, out.error
    total = resolve_target("T4").total_memory
    # free: the card less the CUDA context the simulated card holds (400 MB, published) and
    # what the allocator reserved
    assert seen["info"] == (total - 400_000_000 - seen["reserved"], total) == seen["memory_info"]
    assert seen["reserved"] >= 4 << 20 and seen["total"] == total
    assert not any("no GPU was named" in n for n in out.report.notes)


def test_mem_get_info_without_a_card_answers_for_the_default_and_says_so():
    seen: dict = {}
    out, _ = run("""
        import torch
        seen["info"] = torch.cuda.mem_get_info()
        seen["props"] = (torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen["info"] == (DEFAULT_CARD.total_memory, DEFAULT_CARD.total_memory)
    assert seen["props"] == (DEFAULT_CARD.name, DEFAULT_CARD.total_memory)
    notes = [n for n in out.report.notes if "no GPU was named" in n]
    assert len(notes) == 1 and DEFAULT_CARD.name in notes[0] and "--gpu" in notes[0]
    quiet, _ = run("import torch\nx = torch.ones(3, device='cuda')\n")
    assert not any("no GPU was named" in n for n in quiet.report.notes)


# -- sdpa_kernel: flash on inputs flash cannot take ----------------------------------------------
FLASH_CELL = """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(2, 4, 128, {d}, device="cuda", dtype=torch.{dtype}, requires_grad=True)
    mask = torch.ones(128, 128, dtype=torch.bool, device="cuda") if {mask} else None
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    out.sum().backward()
"""


@pytest.mark.parametrize("dtype,d,mask,why", [
    ("float32", 64, False, "float16 or bfloat16"),
    ("float16", 512, False, "at most 256"),
    ("float16", 64, True, "attn_mask"),
])
def test_flash_only_on_inputs_flash_cannot_take_raises_like_cuda(dtype, d, mask, why):
    before = compat_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, _ = run(FLASH_CELL.format(dtype=dtype, d=d, mask=mask), gpu="A100")
    assert type(out.error) is RuntimeError and str(out.error) == NO_KERNEL
    # as torch does: a warning per backend saying why it was not used, at the cell's line
    said = [str(w.message) for w in caught if w.filename == "<cell>"]
    assert said[0] == "Memory efficient kernel not used because: Memory efficient attention " \
                      "has been runtime disabled."
    assert said[1].startswith("Flash attention kernel not used because: ") and why in said[1]
    assert said[2].startswith("cuDNN attention kernel not used because: ") and len(said) == 3
    assert compat_state() == before
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()


def test_flash_only_on_inputs_flash_takes_runs_flash():
    out, _ = run(FLASH_CELL.format(dtype="float16", d=64, mask=False), gpu="A100")
    assert out.error is None, out.error
    assert any("flash 1x" in n for n in out.report.notes)
    # a card without flash (sm75): no kernel
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t4, _ = run(FLASH_CELL.format(dtype="float16", d=64, mask=False), gpu="T4")
    assert str(t4.error) == NO_KERNEL
    assert any("Flash attention kernel" in str(w.message) and "sm80 to sm121" in str(w.message)
               for w in caught)


def test_sdpa_choice_follows_the_switches_and_priority():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    half = torch.empty(2, 4, 128, 64, dtype=torch.float16, device="meta")
    full = torch.empty(2, 4, 128, 64, dtype=torch.float32, device="meta")
    a100 = (8, 0)
    assert choose_sdpa_backend(half, half, half, None, 0.0, a100) == "flash"
    assert choose_sdpa_backend(full, full, full, None, 0.0, a100) == "efficient"
    assert choose_sdpa_backend(full, full, full, None, 0.0, (7, 5)) == "efficient"
    odd = torch.empty(2, 4, 128, 30, dtype=torch.float32, device="meta")  # not a multiple of 4
    assert choose_sdpa_backend(odd, odd, odd, None, 0.0, a100) == "math"
    assert choose_sdpa_backend(odd, odd, odd, None, 0.0, (7, 5)) == "efficient"  # no tensor cores
    # causal attention with seqlen_q != seqlen_k is not flash's
    k = torch.empty(2, 4, 96, 64, dtype=torch.float16, device="meta")
    assert choose_sdpa_backend(half, k, k, None, 0.0, a100, is_causal=True) == "efficient"
    with sdpa_kernel([SDPBackend.MATH]):
        assert choose_sdpa_backend(half, half, half, None, 0.0, a100) == "math"
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        assert choose_sdpa_backend(half, half, half, None, 0.0, a100) == "cudnn"
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
        assert choose_sdpa_backend(half, half, half, None, 0.0, a100) == "efficient"
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]), warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="No available kernel"):
            choose_sdpa_backend(half, half, half, None, 0.0, (3, 7))
    with sdpa_kernel([]):
        with pytest.raises(RuntimeError) as info:
            choose_sdpa_backend(half, half, half, None, 0.0, a100)
    assert str(info.value) == NO_BACKEND


def test_switches_a_cell_flips_are_put_back():
    before = compat_state()
    out, _ = run("""
        import torch
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_math_sdp(False)
        raise KeyboardInterrupt
    """)
    assert isinstance(out.error, KeyboardInterrupt)
    assert compat_state() == before


# -- transformers ------------------------------------------------------------------------------
GPT2_CELL = """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    F = torch.nn.functional
    rec.orig = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = rec
    try:
        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100, attn_implementation="sdpa")
        model = GPT2LMHeadModel(cfg).to(dev)
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model.train()
        ids = torch.randint(0, 100, (2, 16), device=dev)
        mask = torch.ones(2, 16, dtype=torch.long, device=dev) if with_mask else None
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
    finally:
        F.scaled_dot_product_attention = rec.orig
"""


def _eager_calls(with_mask: bool) -> list[tuple]:
    rec = SDPARecorder()
    exec(textwrap.dedent(GPT2_CELL), {"rec": rec, "dev": "cpu", "with_mask": with_mask})
    return rec.calls


@pytest.mark.parametrize("with_mask", [False, True])
def test_transformers_attention_takes_the_eager_path(with_mask):
    pytest.importorskip("transformers")
    import transformers.utils.import_utils  # imported before the run: patched at install

    expected = _eager_calls(with_mask)
    assert expected and all(c == (True, None) for c in expected)  # no mask, is_causal=True
    before = compat_state()
    rec = SDPARecorder()
    out, _ = run(GPT2_CELL, {"rec": rec, "dev": "cuda", "with_mask": with_mask}, gpu="A100")
    assert out.error is None, out.error
    # forward and the checkpointed recompute in backward: each SDPA call as in the eager run
    assert len(expected) == 4 and rec.calls == expected
    assert compat_state() == before


def test_save_pretrained_of_a_simulated_model_writes_no_weights(tmp_path):
    pytest.importorskip("transformers")
    import safetensors.torch
    import transformers.modeling_utils

    before = compat_state()
    out, _ = run(f"""
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100)).cuda()
        model.save_pretrained({str(tmp_path)!r})
    """)
    assert out.error is None, out.error
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json"]
    weights = str(tmp_path / "model.safetensors")
    assert (f"safetensors save_file({weights!r}) skipped: the tensors are simulated (no data); "
            "nothing was written") in out.report.notes
    assert transformers.modeling_utils.safe_save_file is safetensors.torch.save_file
    assert compat_state() == before


_FRESH_IMPORT = r"""
import sys, textwrap
sys.path[:0] = ["tests/backends", "tests"]
from test_sim_compat import GPT2_CELL, SDPARecorder, run, _eager_calls
from memmagic.backends.sim.compat import _ImportWatch
assert "transformers" not in sys.modules
out, _ = run("import transformers\nfrom transformers import ViTModel, GPT2Model\n")
assert out.error is None, out.error
import transformers.utils.import_utils as iu, safetensors.torch as st, transformers.pytorch_utils as pu
orig = iu.is_fake_tensor
assert orig.__module__ == "transformers.utils.import_utils" and not hasattr(orig, "__wrapped__")
assert pu.storage_ptr is st.storage_ptr and not hasattr(st.storage_ptr, "__wrapped__")
assert not any(isinstance(f, _ImportWatch) for f in sys.meta_path)
rec = SDPARecorder()
out, _ = run(GPT2_CELL, {"rec": rec, "dev": "cuda", "with_mask": True}, gpu="A100")
assert out.error is None, out.error
expected = _eager_calls(True)
assert rec.calls == expected, (rec.calls, expected)
print("ok")
"""


def test_transformers_imported_inside_a_sim_cell():
    pytest.importorskip("transformers")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _FRESH_IMPORT], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "MPLBACKEND": "Agg"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_compat_is_undone_after_an_exception():
    pytest.importorskip("transformers")
    import safetensors.torch
    import transformers.utils.import_utils as iu

    before = compat_state()
    patches = Patches()
    try:
        install_compat(patches, [])
        assert iu.is_fake_tensor is not before["transformers.utils.import_utils"]["is_fake_tensor"]
        assert os.environ["HF_DEACTIVATE_ASYNC_LOAD"] == "1" and "_make_subclass" in torch.Tensor.__dict__
        assert safetensors.torch.save_file.__wrapped__ is before["safetensors.torch"]["save_file"]
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    finally:
        patches.restore()
    assert compat_state() == before


# -- libraries' cached probes --------------------------------------------------------------
def test_cached_cuda_probes_of_transformers_answer_per_side():
    pytest.importorskip("transformers")
    import transformers.utils.import_utils as iu

    seen: dict = {}
    assert iu.is_torch_cuda_available() is False  # a real cell first: cached as False
    out, _ = run("""
        import transformers.utils.import_utils as iu
        seen["cuda"] = iu.is_torch_cuda_available()
        seen["bf16"] = iu.is_torch_bf16_gpu_available()
    """, {"seen": Recorder(seen)}, gpu="A100")
    assert out.error is None, out.error
    assert seen == {"cuda": True, "bf16": True}  # the simulated GPU's answers, not the cache's
    assert iu.is_torch_cuda_available() is False and iu.is_torch_bf16_gpu_available() is False


def test_patches_set_item_puts_back_or_removes_an_environment_variable(monkeypatch):
    monkeypatch.delenv("MEMMAGIC_TEST_VAR", raising=False)
    monkeypatch.setenv("MEMMAGIC_TEST_OLD", "old")
    patches = Patches()
    patches.set_item(os.environ, "MEMMAGIC_TEST_VAR", "1")
    patches.set_item(os.environ, "MEMMAGIC_TEST_OLD", "new")
    assert os.environ["MEMMAGIC_TEST_VAR"] == "1" and os.environ["MEMMAGIC_TEST_OLD"] == "new"
    patches.restore()
    assert "MEMMAGIC_TEST_VAR" not in os.environ and os.environ["MEMMAGIC_TEST_OLD"] == "old"


def test_from_pretrained_with_a_device_map_loads_a_checkpoint_onto_the_simulated_gpu(tmp_path):
    """transformers copies weights on worker threads (outside the simulation) unless told not
    to, and reads safetensors through torch.asarray over the file's storage."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=500, bos_token_id=0, eos_token_id=0,
                               n_positions=64)).save_pretrained(tmp_path)
    seen: dict = {}
    out, _ = run(f"""
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, device_map="cuda")
        seen["device"] = str(model.transformer.h[0].attn.c_attn.weight.device)
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen["device"] == "cuda:0"
    n = sum(p.numel() for p in GPT2LMHeadModel.from_pretrained(tmp_path).parameters())
    assert out.report.after - out.report.before >= n * 4  # the weights, fp32, on the card


def test_dynamos_map_of_torchs_functions_keys_torchs_own_after_a_run():
    """A run replaces some of torch's functions (torch.nested's makers, torch.cuda's
    queries): dynamo's map of torch's functions to how it traces them (built once for the
    process) is built from torch's own before that, so a lookup in a run (flex_attention,
    a static KV cache) does not stop on "Duplicate torch object", and after the run the
    map still knows torch's own functions."""
    import torch._dynamo.trace_rules as rules

    rules.get_torch_obj_rule_map.cache_clear()
    try:
        out, _ = run("""
            import torch
            import torch._dynamo.trace_rules as rules
            seen["looked"] = rules.lookup(torch.nested.nested_tensor) is not None
        """, {"seen": Recorder(seen := {})})
        assert out.error is None, out.error
        assert torch.nested.nested_tensor in rules.get_torch_obj_rule_map()
        assert torch.cuda.is_available in rules.get_torch_obj_rule_map()
    finally:
        rules.get_torch_obj_rule_map.cache_clear()
