"""Private torch APIs are reached only through memmagic/core/_torch_private.py.

The rule this test applies to every memmagic/**/*.py outside the private layer (read
from the source with ``ast``, nothing is imported). The private layer is
``_torch_private.py``, or a ``_torch_private/`` package if it becomes one:

1. No import of a torch module whose dotted path has a part with a leading underscore, in
   any form (``import torch._dynamo.eval_frame``, ``from torch._subclasses import ...``,
   ``from torch.utils._python_dispatch import TorchDispatchMode``), and no import of a
   leading-underscore name from any torch module (``from torch.utils.data.dataloader
   import _SingleProcessDataLoaderIter``).
2. No attribute chain rooted at the name ``torch`` with a leading-underscore part
   (``torch._C._nn._parse_to``, ``torch.cuda.memory._snapshot``, ``torch.utils._pytree``).
3. No leading-underscore attribute that torch's own objects carry, read or written on any
   object but ``self``/``cls``, directly (``t._version``, ``m._buffers``, ``lib._destroy()``,
   ``tud.DataLoader._get_iterator``) or by name as a string (``getattr(f, "_schema")``,
   ``patches.set(mod, "_default_to_fused_or_foreach", ...)``, ``d.get("_orig_mod")``), nor
   a string starting with ``"_saved_"`` (an autograd node's saved-tensor attributes), nor a
   subscript of a class's ``__dict__`` (``FakeTensor.__dict__["device"]``). "Torch's own"
   is measured, not listed by hand: the leading-underscore names in ``dir()`` of a tensor,
   a module, a parameter, an optimizer, a DataLoader, an op overload, a Library, a
   FakeTensor and its mode, an autograd node and torch's hook-registry modules, plus
   ``_TORCH_EXTRAS`` (attributes of objects too costly to build here: dynamo's).

Not private by this rule: op names under ``torch.ops.aten`` (``torch.ops.aten.
_local_scalar_dense``) or any name bound to it (``_aten = torch.ops.aten``): ops are public
by their schema. Public attributes of private classes (``FakeTensor.constant``,
``fake_device``) are reached through the class that ``_torch_private`` re-exports.
Non-torch private names (``sys._getframe``, ``warnings._filters_mutated``) are out of scope.

``ALLOWED`` lists the private uses that remain, by file, each with the exact names still
used there: the test fails when a new one appears anywhere and when an allowed one is no
longer used (a stale entry), so the list can only shrink to empty.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import memmagic
from memmagic.core import _torch_private as priv

ROOT = pathlib.Path(memmagic.__file__).parent
PRIVATE_MODULE = "core/_torch_private.py"


def in_private_layer(rel: str) -> bool:
    """Whether ``rel`` (a path under memmagic/) belongs to the private layer."""
    return rel == PRIVATE_MODULE or rel.startswith("core/_torch_private/")

# What remains, file -> the names it still uses (the lead is moving these behind
# _torch_private; see the functions named in the comments).
ALLOWED: dict[str, set[str]] = {}

# Leading-underscore attributes of torch objects that the test does not build (dynamo).
_TORCH_EXTRAS = {"_orig_mod", "_callback_from_stance"}
_STRING_PREFIXES = ("_saved_",)


def _is_private_name(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_part(dotted: str) -> bool:
    return any(_is_private_name(p) for p in dotted.split("."))


def _torch_private_attrs() -> frozenset[str]:
    import importlib

    import torch.library
    import torch.utils.data

    modules = [importlib.import_module(m) for m in
               ("torch.nn.modules.module", "torch.optim.optimizer", "torch.cuda.memory")]
    x = torch.ones(2, requires_grad=True)
    lin = torch.nn.Linear(1, 1)
    objects = (x, (x * 2).grad_fn, lin, torch.nn.Parameter(torch.ones(1)),
               torch.optim.SGD(lin.parameters()), torch.utils.data.DataLoader([1]),
               torch.ops.aten.add.Tensor, torch.library.Library, torch.autograd.Function,
               priv.FakeTensor, priv.new_fake_mode(), *modules)
    names = {n for o in objects for n in dir(o) if _is_private_name(n)}
    return frozenset(names | _TORCH_EXTRAS)


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _ops_aliases(tree: ast.Module) -> set[str]:
    """Names bound to ``torch.ops.<namespace>`` (``_aten = torch.ops.aten``)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and (_dotted(n.value) or "").startswith("torch.ops."):
            out.update(t.id for t in n.targets if isinstance(t, ast.Name))
    return out


def private_uses(source: str, attrs: frozenset[str]) -> dict[str, list[int]]:
    """The private torch names ``source`` uses (by the rule in the module docstring),
    each with the lines it appears on."""
    tree = ast.parse(source)
    ops = _ops_aliases(tree)
    found: dict[str, list[int]] = {}

    def add(name: str, node: ast.AST) -> None:
        found.setdefault(name, []).append(node.lineno)

    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] == "torch" and _private_part(a.name):
                    add(a.name, n)
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            if n.module.split(".")[0] != "torch":
                continue
            if _private_part(n.module):
                add(n.module, n)
            for a in n.names:
                if _is_private_name(a.name):
                    add(f"{n.module}.{a.name}", n)
        elif isinstance(n, ast.Attribute):
            dotted = _dotted(n)
            if dotted is not None and dotted.startswith("torch."):
                if _private_part(dotted) and not dotted.startswith("torch.ops."):
                    # report the whole chain once, from its outermost attribute
                    add(dotted, n)
                continue
            base = n.value
            if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in ops):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            if _dotted(base) is not None and _dotted(base).startswith("torch."):
                continue  # part of a torch.* chain, judged above
            if n.attr in attrs:
                add(n.attr, n)
        elif isinstance(n, ast.Call):
            strings = []
            if len(n.args) > 1 and not (isinstance(n.args[0], ast.Name) and n.args[0].id == "self"):
                strings.append(n.args[1])  # getattr(x, "_n"), setattr, patches.set(obj, "_n", v)
            if isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args:
                strings.append(n.args[0])  # obj.__dict__.get("_n")
            for s in strings:
                if isinstance(s, ast.Constant) and isinstance(s.value, str) and s.value in attrs:
                    add(s.value, n)
        elif isinstance(n, ast.Subscript):
            if isinstance(n.value, ast.Attribute) and n.value.attr == "__dict__":
                base = n.value.value
                if not (isinstance(base, ast.Name) and base.id in ("self", "cls")):
                    key = n.slice.value if isinstance(n.slice, ast.Constant) else "?"
                    add(f"{ast.unparse(base)}.__dict__[{key!r}]", n)
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            for prefix in _STRING_PREFIXES:
                if n.value.startswith(prefix):
                    add(prefix, n)
    # a torch.* chain is seen at every level (torch._C, torch._C._nn, ...): keep the longest
    chains = [k for k in found if k.startswith("torch.") and "." in k]
    for k in chains:
        if any(o != k and o.startswith(k + ".") for o in chains):
            del found[k]
    return found


@pytest.fixture(scope="module")
def attrs() -> frozenset[str]:
    return _torch_private_attrs()


@pytest.fixture(scope="module")
def uses(attrs) -> dict[str, dict[str, list[int]]]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if in_private_layer(rel):
            continue
        found = private_uses(path.read_text(), attrs)
        if found:
            out[rel] = found
    return out


def test_only_torch_private_uses_private_torch_apis(uses):
    unexpected = {f: {k: v for k, v in names.items() if k not in ALLOWED.get(f, set())}
                  for f, names in uses.items()}
    unexpected = {f: names for f, names in unexpected.items() if names}
    assert unexpected == {}, (
        "private torch APIs outside memmagic/core/_torch_private.py (put them behind a function "
        f"there, with a contract test): {unexpected}")


def test_the_allowlist_is_not_stale(uses):
    stale = {f: sorted(names - set(uses.get(f, {}))) for f, names in ALLOWED.items()}
    stale = {f: names for f, names in stale.items() if names}
    assert stale == {}, f"no longer used: take them out of ALLOWED: {stale}"
    assert set(ALLOWED) <= {"tracking.py", "backends/sim/tracker.py"}  # nothing new allowed


def test_every_allowlisted_use_has_its_replacement():
    for name in ("TorchDispatchMode", "dynamo_stance_callback_slot", "tensor_version",
                 "op_schema", "own_parameters", "own_buffers", "child_modules", "compiled_inner",
                 "node_saved_values", "PARSE_TO_FUNCTION"):
        assert hasattr(priv, name), name


SNIPPETS = {
    "import torch._dynamo.eval_frame as ef": "torch._dynamo.eval_frame",
    "from torch.utils._python_dispatch import TorchDispatchMode": "torch.utils._python_dispatch",
    "from torch.utils.data.dataloader import _SingleProcessDataLoaderIter":
        "torch.utils.data.dataloader._SingleProcessDataLoaderIter",
    "torch._C._nn._parse_to('cpu')": "torch._C._nn._parse_to",
    "snap = torch.cuda.memory._snapshot(0)": "torch.cuda.memory._snapshot",
    "v = t._version": "_version",
    "lib._destroy()": "_destroy",
    "f = tud.DataLoader._get_iterator": "_get_iterator",
    "s = getattr(func, '_schema', None)": "_schema",
    "patches.set(mod, '_default_to_fused_or_foreach', f)": "_default_to_fused_or_foreach",
    "for b in m._buffers.values(): pass": "_buffers",
    "ok = name.startswith('_saved_')": "_saved_",
    "g = FakeTensor.__dict__['device'].fget": "FakeTensor.__dict__['device']",
}


@pytest.mark.parametrize("src,name", SNIPPETS.items(), ids=list(SNIPPETS.values()))
def test_the_rule_catches_each_form(attrs, src, name):
    assert name in private_uses(src, attrs)


@pytest.mark.parametrize("src", [
    "x = torch.ops.aten._local_scalar_dense.default",
    "_aten = torch.ops.aten\nop = _aten._scaled_dot_product_attention_math.default",
    "import torch.utils.data as tud\nx = tud.DataLoader",
    "self._version = 1\ny = self._buffers",
    "f = sys._getframe(1)",
    "object.__getattribute__(self, '_name')",
    "from memmagic.core import _torch_private as _priv\n_priv.storage_key",
    "tracker._live.get(1)",  # memmagic's own private attribute, not a torch one
    "d = torch.__file__\nf = torch.Tensor.__deepcopy__",  # dunders are Python's, not private
])
def test_the_rule_leaves_public_and_own_names_alone(attrs, src):
    assert private_uses(src, attrs) == {}


# -- import direction: the private layer and the op cache -------------------------------
def _memmagic_imports(path: pathlib.Path) -> set[str]:
    """The memmagic modules ``path`` imports (absolute dotted names)."""
    tree = ast.parse(path.read_text())
    pkg = ["memmagic", *path.relative_to(ROOT).parent.parts]
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            base = pkg[: len(pkg) - n.level + 1] if n.level else []
            mod = ".".join(base + ([n.module] if n.module else []))
            if mod.split(".")[0] != "memmagic":
                continue
            for a in n.names:  # a name that is a module counts as that module
                sub = ROOT.parent.joinpath(*f"{mod}.{a.name}".split("."))
                is_mod = sub.with_suffix(".py").exists() or (sub / "__init__.py").exists()
                out.add(f"{mod}.{a.name}" if is_mod or not n.module else mod)
        elif isinstance(n, ast.Import):
            out.update(a.name for a in n.names if a.name.split(".")[0] == "memmagic")
    return out


def test_torch_private_is_the_bottom_layer():
    layer = [p for p in ROOT.rglob("*.py") if in_private_layer(p.relative_to(ROOT).as_posix())]
    assert ROOT / PRIVATE_MODULE in layer
    assert {p.name: _memmagic_imports(p) for p in layer} == {p.name: set() for p in layer}


def test_the_private_layer_is_one_module_or_package():
    assert in_private_layer("core/_torch_private.py")
    assert not in_private_layer("core/_torch_private_dist.py")
    assert in_private_layer("core/_torch_private/fake.py")
    assert not in_private_layer("core/tracking.py") and not in_private_layer("backends/sim/op_cache.py")


def test_the_op_cache_uses_torch_and_the_private_layer_only():
    path = ROOT / "backends" / "sim" / "op_cache.py"
    assert _memmagic_imports(path) == {"memmagic.core._torch_private"}
    assert not hasattr(priv, "FakeOutputCache")  # the engine moved out of the shim layer
