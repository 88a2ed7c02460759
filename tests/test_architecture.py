"""The shape of the house, read from the source: imports flow one way, from `core` out.

Parses every module's imports (module level and inside functions) with `ast`, and fails on
an import cycle, on an arrow that runs the wrong way (the core importing the periphery),
on a private name imported from another module, and on a module shadowed by a function.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import tree_attention_edu as tae

ROOT = Path(tae.__file__).resolve().parent
PACKAGE = "tree_attention_edu"

# Layers, lowest first: a module may import from its own layer and the ones below.
LAYERS = {
    "core": 0,
    "theory": 1,
    "perf": 1,
    "plots": 1,  # figures from plain data: imports nothing of the package
    "commandline": 1,  # argparse plumbing: imports nothing of the package
    "llama": 2,
    "cluster": 3,
    "cli": 4,
    "__init__": 5,  # the public API re-exports
    "__main__": 5,
}
ALLOWED = {  # beyond "lower layers": which packages each may use
    "core": {"core"},
    "theory": {"core", "theory"},
    "perf": {"core", "perf"},
    "plots": {"plots"},
    "commandline": {"commandline"},
    "llama": {"core", "perf", "llama"},
    "cluster": {"core", "perf", "llama", "cluster", "commandline"},
    "cli": {"core", "theory", "perf", "llama", "cluster", "cli", "commandline", "plots",
            "__init__"},
    "__init__": set(LAYERS),
    "__main__": {"cli"},
}


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package."""
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = modules()


def resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module of a relative import `from {'.' * level}{name} import ...`."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports(module: str) -> list[tuple[str, list[str]]]:
    """`(imported module, names)` for every import of the package's own modules."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = (resolve(module, is_package, node.level, node.module) if node.level
                      else node.module or "")
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                names = [a.name for a in node.names]
                # `from pkg import sub` imports the submodule `pkg.sub` where one exists
                subs = [n for n in names if f"{target}.{n}" in MODULES]
                found += [(f"{target}.{n}", []) for n in subs]
                rest = [n for n in names if n not in subs]
                if rest:
                    found.append((target, rest))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names
                      if a.name == PACKAGE or a.name.startswith(PACKAGE + ".")]
    return found


def area(module: str) -> str:
    """The top-level part of the package a module belongs to (`core`, `perf`, ...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def wrong_way(edges: list[tuple[str, str]]) -> list[str]:
    """The `(module, imported)` edges that break `ALLOWED`."""
    return [f"{m} -> {t}" for m, t in edges if area(t) not in ALLOWED[area(m)]
            and area(t) != area(m)]


def test_imports_flow_one_way():
    edges = [(m, t) for m in MODULES for t, _ in imports(m)]
    assert wrong_way(edges) == [], "imports that run the wrong way"


def test_the_direction_check_can_fail():
    """Planted: the core asking the cost model for "auto", a theory module importing the
    model, plots importing JAX code of the package."""
    planted = [("tree_attention_edu.core.decode", "tree_attention_edu.perf.costmodel"),
               ("tree_attention_edu.theory.bayes", "tree_attention_edu.llama.model"),
               ("tree_attention_edu.plots", "tree_attention_edu.core.states"),
               ("tree_attention_edu.perf.calibrate", "tree_attention_edu.core.decode")]
    assert wrong_way(planted) == [f"{m} -> {t}" for m, t in planted[:3]]


def test_the_core_imports_nothing_outside_itself():
    outside = [f"{m} -> {t}" for m in MODULES if area(m) == "core"
               for t, _ in imports(m) if area(t) != "core"]
    assert outside == []


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for target, _ in imports(module):
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != module and target in MODULES:
                graph[module].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph, or None (depth-first search with colours). A package's
    `__init__` importing its own submodules is not an edge back (Python loads the package
    first), so edges from a package to its own submodules are left out."""
    colour = dict.fromkeys(graph, 0)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + "."):  # a package importing its submodule
                continue
            if colour[nxt] == 1:
                return [*stack[stack.index(nxt):], nxt]
            if colour[nxt] == 0 and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        colour[node] = 2
        return None

    for node in sorted(graph):
        if colour[node] == 0 and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    assert find_cycle(_graph()) is None, " -> ".join(find_cycle(_graph()) or [])


def test_the_cycle_finder_finds_cycles():
    """The check above can fail: a planted cycle (and a package importing its own
    submodule, which is no cycle) are told apart."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"p": {"p.x"}, "p.x": {"p"}}) is None
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_private_names_imported_across_modules():
    private = [f"{m}: from {t} import {n}" for m in MODULES for t, names in imports(m)
               for n in names if n.startswith("_") and n != "__version__"]
    assert private == []


def test_no_private_attribute_of_another_module():
    """`module._name` where `module` is another of the package's modules."""
    found = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                aliases |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Import):
                aliases |= {a.asname or a.name.split(".")[0] for a in node.names}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                    and node.value.id in aliases):
                target = node.value.id
                if any(m.rsplit(".", 1)[-1] == target for m in MODULES):
                    found.append(f"{module}: {target}.{node.attr}")
    assert found == []


@pytest.mark.parametrize("package", sorted(m for m, p in MODULES.items()
                                           if p.name == "__init__.py"))
def test_no_module_is_shadowed_by_a_function(package):
    """`tree_attention_edu.X` (or `core.X`, ...) is the submodule X wherever one exists:
    a re-exported function of the same name would hide it."""
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        sub = importlib.import_module(f"{package}.{info.name}")
        assert getattr(pkg, info.name, sub) is sub, f"{package}.{info.name} is shadowed"


def test_decode_path_reads_in_one_screen():
    """`tree_decode`'s path, from the public function to the merge, fits on one screen:
    `tree_decode` and its jitted body `_tree` together are at most 60 lines of code
    (docstrings aside)."""
    from tree_attention_edu.core import decode

    tree = ast.parse(Path(decode.__file__).read_text())
    lines = 0
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in ("tree_decode", "_tree"):
            body = node.body[1:] if isinstance(node.body[0], ast.Expr) else node.body
            lines += body[-1].end_lineno - body[0].lineno + 1
    assert 0 < lines <= 60, lines


def test_readme_map_matches_the_code():
    """Every module the README's layout names exists, and every module exists in it."""
    readme = (ROOT.parent / "README.md").read_text()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0].split("```")[1]
    for module in MODULES:
        if module.endswith(("__main__",)) or module == PACKAGE:
            continue
        leaf = module.rsplit(".", 1)[-1]
        if module.startswith(f"{PACKAGE}.cli."):  # listed by name on the cli/ line
            assert re.search(rf"\b{leaf}\b", section), f"{module} not in the map"
            continue
        assert f"{leaf}/" in section or f"{leaf}.py" in section, f"{module} not in the map"
    for named in re.findall(r"(\w+)\.py\b", section):  # and nothing the map names is gone
        assert named == "__init__" or any(m.rsplit(".", 1)[-1] == named for m in MODULES), (
            f"{named}.py is no module")
