"""The package's shape, as the redesign left it (issue 22), checked from the source with
``ast`` (nothing imported): imports point one way, no module uses another's private
names, functions stay short, the magic stays thin."""

from __future__ import annotations

import ast
import pathlib

import memmagic

ROOT = pathlib.Path(memmagic.__file__).parent
LONGEST = 60  # lines of a function, unless a comment at its top says why it is one piece


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in sorted(ROOT.rglob("*.py")):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, str]]:
    """(module imported, name imported from it or "") of every import in ``path``, at any
    depth (imports inside functions count: they make cycles too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((sub, "") if sub in MODULES else (target, alias.name))
        elif isinstance(node, ast.Import):
            out.extend((alias.name, "") for alias in node.names)
    return [(m, n) for m, n in out if m in MODULES]


def test_no_two_modules_import_each_other():
    graph = {m: {t for t, _ in _imports(m, p)} - {m} for m, p in MODULES.items()}

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            m = todo.pop()
            if m == b:
                return True
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
        return False

    cycles = sorted((a, b) for a in graph for b in graph[a] if a < b and reaches(b, a))
    assert cycles == []


def test_no_module_uses_another_modules_private_names():
    found = [(m, t, n) for m, p in MODULES.items() for t, n in _imports(m, p)
             if n.startswith("_") and not n.startswith("__")
             and t != "memmagic.core._torch_private"]
    assert found == []


def test_functions_are_short_or_say_why_not():
    long = []
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.end_lineno - node.lineno > LONGEST:
                top = "\n".join(lines[node.lineno - 1:node.lineno + 12])
                if "One piece" not in top:
                    long.append(f"{name}.{node.name} ({node.end_lineno - node.lineno} lines)")
    assert long == []


def test_the_magic_is_thin():
    magic = MODULES["memmagic.frontends.magics"]
    assert len(magic.read_text().splitlines()) < 250
    imported = {t for t, _ in _imports("memmagic.frontends.magics", magic)}
    # the magic reaches the library through the pipeline: it runs no backend, reads no
    # failure and asks no doctor itself (the notebook's simulated GPU is the shell's)
    assert imported & {"memmagic.doctor", "memmagic.core.failures", "memmagic.core.tracking",
                       "memmagic.backends.cpu", "memmagic.backends.cuda",
                       "memmagic.backends.sim.backend"} == set()
    assert "memmagic.pipeline" in imported


def test_the_simulator_has_one_door():
    """Code outside ``memmagic.backends.sim`` imports its names from the package, never
    from its modules (the names it exports are its interface)."""
    inside = "memmagic.backends.sim"
    found = sorted(f"{m} imports {t}" for m, p in MODULES.items()
                   if not (m == inside or m.startswith(inside + "."))
                   for t, _ in _imports(m, p) if t.startswith(inside + "."))
    assert found == []


# The layers, bottom first: a module imports from its own layer or those below, never above
# (front ends -> pipeline -> doctor -> what-if -> charts -> backends -> measurement core ->
# the report's data). The folder is the layer: a new module lands in one by where it lives.
LAYERS = [
    ("data", ("memmagic.report", "memmagic.trace", "memmagic.zoo")),
    ("core", ("memmagic.core",)),
    ("backends", ("memmagic.backends",)),
    ("charts", ("memmagic.charts",)),
    ("whatif", ("memmagic.whatif",)),
    ("doctor", ("memmagic.doctor",)),
    ("pipeline", ("memmagic.pipeline", "memmagic.jobs", "memmagic.api")),
    ("frontends", ("memmagic.frontends",)),
    ("package", ("memmagic", "memmagic._moved")),
]


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer ``module`` belongs to (its longest matching prefix)."""
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = i, prefix.count(".")
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best


def test_every_module_belongs_to_a_layer_and_imports_point_down():
    up = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
                for m, p in MODULES.items() for t, _ in _imports(m, p)
                if layer_of(t) > layer_of(m))
    assert up == []


def test_the_layers_are_the_folders():
    """Every sub-package of memmagic is a layer of its own (or the backends' simulator), so
    the folder list reads as the architecture diagram."""
    folders = {f"memmagic.{p.name}" for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    layered = {prefix for _, prefixes in LAYERS for prefix in prefixes}
    assert folders <= layered
    top = sorted(m for m in MODULES if m.count(".") == 1 and m not in layered
                 and not MODULES[m].name == "__init__.py")
    assert top == ["memmagic.__main__"]  # python -m memmagic


def test_layer_of_reads_the_longest_prefix():
    assert LAYERS[layer_of("memmagic.core.tracking")][0] == "core"
    assert LAYERS[layer_of("memmagic.backends.sim.allocator")][0] == "backends"
    assert LAYERS[layer_of("memmagic.api")][0] == "pipeline"
    assert LAYERS[layer_of("memmagic")][0] == "package"


def test_the_code_explains_itself_without_issue_numbers():
    """A docstring or comment says why, not which issue asked (torch's issue numbers, as
    sources of a fact, are fine)."""
    import re

    ours = re.compile(r"(?<!pytorch )\bissue \d+", re.I)
    found = [f"{name}:{i}" for name, path in MODULES.items()
             for i, line in enumerate(path.read_text().splitlines(), 1) if ours.search(line)]
    assert found == []
