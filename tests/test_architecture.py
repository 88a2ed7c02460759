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
    "course": 1,  # the student release and its grading (nbgrader): nothing of the package
    "llama": 2,
    "cluster": 3,
    "__init__": 4,  # the public API re-exports
    "cli": 5,  # commands: use everything (the version from `__init__`); nothing imports them
    "__main__": 6,
}
ALLOWED = {  # beyond "lower layers": which packages each may use
    "core": {"core"},
    "theory": {"core", "theory"},
    "perf": {"core", "perf"},
    "plots": {"plots"},
    "course": {"course"},
    "llama": {"core", "perf", "llama"},
    "cluster": {"core", "perf", "llama", "cluster"},
    "cli": {"core", "theory", "perf", "llama", "cluster", "cli", "plots", "course", "__init__"},
    "__init__": {a for a, layer in LAYERS.items() if layer <= LAYERS["__init__"]},
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
            target = (
                resolve(module, is_package, node.level, node.module)
                if node.level
                else node.module or ""
            )
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                names = [a.name for a in node.names]
                # `from pkg import sub` imports the submodule `pkg.sub` where one exists
                subs = [n for n in names if f"{target}.{n}" in MODULES]
                found += [(f"{target}.{n}", []) for n in subs]
                rest = [n for n in names if n not in subs]
                if rest:
                    found.append((target, rest))
        elif isinstance(node, ast.Import):
            found += [
                (a.name, [])
                for a in node.names
                if a.name == PACKAGE or a.name.startswith(PACKAGE + ".")
            ]
    return found


def area(module: str) -> str:
    """The top-level part of the package a module belongs to (`core`, `perf`, ...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def wrong_way(edges: list[tuple[str, str]]) -> list[str]:
    """The `(module, imported)` edges that break `ALLOWED` or climb `LAYERS`."""
    return [
        f"{m} -> {t}"
        for m, t in edges
        if area(t) != area(m)
        and (area(t) not in ALLOWED[area(m)] or LAYERS[area(t)] > LAYERS[area(m)])
    ]


def test_the_layers_are_in_order():
    """What each area may import sits on its own layer or below: `ALLOWED` and `LAYERS`
    say the same thing."""
    assert set(ALLOWED) == set(LAYERS)
    up = [f"{a} -> {b}" for a, allowed in ALLOWED.items() for b in allowed if LAYERS[b] > LAYERS[a]]
    assert up == []


def test_imports_flow_one_way():
    edges = [(m, t) for m in MODULES for t, _ in imports(m)]
    assert wrong_way(edges) == [], "imports that run the wrong way"


def test_the_direction_check_can_fail():
    """Planted: the core asking the cost model for "auto", a theory module importing the
    model, plots importing JAX code of the package."""
    planted = [
        ("tree_attention_edu.core.decode", "tree_attention_edu.perf.costmodel"),
        ("tree_attention_edu.theory.bayes", "tree_attention_edu.llama.model"),
        ("tree_attention_edu.plots", "tree_attention_edu.core.states"),
        ("tree_attention_edu.perf.calibrate", "tree_attention_edu.core.decode"),
    ]
    assert wrong_way(planted) == [f"{m} -> {t}" for m, t in planted[:3]]
    # an area allowed by name but on a higher layer is still refused
    ALLOWED["perf"].add("cluster")
    try:
        assert (
            wrong_way([("tree_attention_edu.perf.calibrate", "tree_attention_edu.cluster.netns")])
            != []
        )
    finally:
        ALLOWED["perf"].discard("cluster")


def test_the_core_imports_nothing_outside_itself():
    outside = [
        f"{m} -> {t}"
        for m in MODULES
        if area(m) == "core"
        for t, _ in imports(m)
        if area(t) != "core"
    ]
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
                return [*stack[stack.index(nxt) :], nxt]
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
    private = [
        f"{m}: from {t} import {n}"
        for m in MODULES
        for t, names in imports(m)
        for n in names
        if n.startswith("_") and n != "__version__"
    ]
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
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                target = node.value.id
                if any(m.rsplit(".", 1)[-1] == target for m in MODULES):
                    found.append(f"{module}: {target}.{node.attr}")
    assert found == []


@pytest.mark.parametrize(
    "package", sorted(m for m, p in MODULES.items() if p.name == "__init__.py")
)
def test_no_module_is_shadowed_by_a_function(package):
    """`tree_attention_edu.X` (or `core.X`, ...) is the submodule X wherever one exists:
    a re-exported function of the same name would hide it."""
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        sub = importlib.import_module(f"{package}.{info.name}")
        assert getattr(pkg, info.name, sub) is sub, f"{package}.{info.name} is shadowed"


def _code_lines(fn: ast.FunctionDef) -> int:
    """Lines of a function's code, its docstring aside."""
    body = (
        fn.body[1:]
        if (isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant))
        else fn.body
    )
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def test_decode_path_reads_in_one_screen():
    """`tree_decode`'s own path through `core.decode`, from the public function to the
    merge (the functions of `core.decode` the call graph reaches from `tree_decode`:
    `make_plan`, `_place`, `_tree`, `_sharded`, `Plan.local`, ...), is at most 120 lines of
    code, docstrings aside: two screens a student reads top to bottom."""
    sources = _core_sources()
    decode = f"{CORE}.decode"
    _, reached = checks_on_the_decode_path(sources, [f"{decode}.tree_decode"], set())
    functions = _functions(decode, sources[decode])
    path = sorted(n for n in reached if n in functions)
    assert {
        f"{decode}.tree_decode",
        f"{decode}.make_plan",
        f"{decode}._tree",
        f"{decode}.Plan.local",
    } <= set(path), path
    lines = sum(_code_lines(functions[n]) for n in path)
    assert lines <= 120, (lines, path)


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 700, 80


def long_modules(sizes: dict[str, int]) -> list[str]:
    return [f"{m}: {n} lines" for m, n in sizes.items() if n > MAX_MODULE_LINES]


def long_functions(module: str, source: str) -> list[str]:
    """Functions and methods (nested ones included) of more than `MAX_FUNCTION_LINES`
    lines, counted as an editor shows them: from `def` to the last line, signature,
    docstring, comments and blank lines included."""
    return [
        f"{module}.{node.name}: {n} lines"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
    ]


def test_modules_and_functions_are_cut_at_their_seams():
    """No module of the package over 700 lines, no function over 80: a longer one has a
    seam (ARCHITECTURE.md)."""
    sizes = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    assert long_modules(sizes) == []
    assert [f for m, p in MODULES.items() for f in long_functions(m, p.read_text())] == []


def test_the_length_rules_can_fail():
    assert long_modules({"a": 701, "b": 700}) == ["a: 701 lines"]
    body = "\n".join(f"    x{i} = {i}" for i in range(78))
    assert long_functions("m", f"def f():\n{body}\n    return 0\n") == []  # 80 lines
    doc = f'def f(\n    a,\n):\n    """Doc."""\n{body}\n'  # a docstring and a signature count
    assert long_functions("m", doc) == ["m.f: 82 lines"]
    assert long_functions("m", f"async def g():\n{body}\n\n    return 0\n") == ["m.g: 81 lines"]


def entry_points(module: str, source: str) -> list[str]:
    """Command-line entry points: a `__main__` guard, or argparse."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            found.append(f"{module}: `if __name__ == '__main__'`")
        if isinstance(node, ast.Import | ast.ImportFrom) and any(
            (a.name if isinstance(node, ast.Import) else node.module or "") == "argparse"
            for a in node.names
        ):
            found.append(f"{module}: imports argparse")
    return found


def test_every_entry_point_is_in_cli():
    """Only `cli/` (and the package's `__main__`) parses command lines or runs as a script,
    and every console script of pyproject.toml points into `cli`."""
    outside = [
        e
        for m, p in MODULES.items()
        if not m.startswith(f"{PACKAGE}.cli") and m != f"{PACKAGE}.__main__"
        for e in entry_points(m, p.read_text())
    ]
    assert outside == []
    scripts = re.search(
        r"\[project\.scripts\]\n(.*?)\n\n",
        (ROOT.parent / "pyproject.toml").read_text() + "\n\n",
        re.S,
    )
    assert scripts and all(
        f"{PACKAGE}.cli" in line for line in scripts.group(1).splitlines() if "=" in line
    )


def test_the_entry_point_rule_can_fail():
    assert entry_points("m", "import argparse\nif __name__ == '__main__':\n    pass\n") == [
        "m: imports argparse",
        "m: `if __name__ == '__main__'`",
    ]


DOTTED = re.compile(rf"\b{PACKAGE}(?:\.[A-Za-z_]\w*)+")


def unresolved(text: str) -> list[str]:
    """Dotted `tree_attention_edu.…` paths in `text` that name no module or attribute."""
    bad = []
    for path in sorted(set(DOTTED.findall(text))):
        parts, obj = path.split("."), None
        for i in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for attr in parts[i:]:
                obj = getattr(obj, attr, None)
                if obj is None:
                    break
            break
        if obj is None:
            bad.append(path)
    return bad


def test_every_dotted_path_resolves():
    """Every `tree_attention_edu.…` path written in the package, the docs, the README, the
    notebooks' sources, the scripts and the recorded results names something that exists
    (paths go stale when code moves)."""
    top = ROOT.parent
    files = [
        *ROOT.rglob("*.py"),
        *(top / "docs").rglob("*.md"),
        top / "README.md",
        *(top / "notebooks").glob("*.py"),
        *(top / "scripts").glob("*.py"),
        *(top / "results").rglob("*.json"),
        *(top / "results").rglob("*.md"),
    ]
    bad = {str(f.relative_to(top)): u for f in files if (u := unresolved(f.read_text()))}
    assert bad == {}


def test_the_path_check_can_fail():
    assert unresolved(f"see {PACKAGE}.core.states.combine and {PACKAGE}.model.Gone") == [
        f"{PACKAGE}.model.Gone"
    ]


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
            f"{named}.py is no module"
        )


# --- checks once, at the door -------------------------------------------------------------
#
# The decoders check their arguments once (`make_plan`, at the public function) and then
# run jitted programs that call the unchecked forms (`kernels.CORES`, `merges.MERGE_CORES`,
# `states.combine_core`). The call graph of the core is read from the source: a call
# `f(...)`, `module.f(...)` or `REGISTRY[...](...)` (a dict literal of functions) is an
# edge, resolved through the module's imports; `plan.local(...)` is `Plan.local`.

CORE = f"{PACKAGE}.core"


def _functions(module: str, source: str) -> dict[str, ast.FunctionDef]:
    """`module.name` (and `module.Class.method`) -> its definition, for top-level ones."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            out[f"{module}.{node.name}"] = node
        elif isinstance(node, ast.ClassDef):
            out.update(
                {
                    f"{module}.{node.name}.{f.name}": f
                    for f in node.body
                    if isinstance(f, ast.FunctionDef)
                }
            )
    return out


def _bindings(module: str, source: str, is_package: bool) -> dict[str, str]:
    """Names a module binds -> what they are: imported modules and functions, and its own
    top-level functions and dict registries (`NAME[...]` -> the registry)."""
    bound = {}
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = resolve(module, is_package, node.level, node.module)
            for a in node.names:
                bound[a.asname or a.name] = f"{base}.{a.name}"
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound[node.name] = f"{module}.{node.name}"
        target = (
            node.targets[0]
            if isinstance(node, ast.Assign)
            else node.target
            if isinstance(node, ast.AnnAssign)
            else None
        )
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Dict):
            bound[target.id] = f"{module}.{target.id}"
    return bound


def _registries(sources: dict[str, str], bindings: dict) -> dict[str, list[str]]:
    """`module.NAME` of a dict literal of functions -> the functions it holds."""
    out = {}
    for module, source in sources.items():
        for node in ast.parse(source).body:
            target = (
                node.targets[0]
                if isinstance(node, ast.Assign)
                else node.target
                if isinstance(node, ast.AnnAssign)
                else None
            )
            if isinstance(target, ast.Name) and isinstance(node.value, ast.Dict):
                out[f"{module}.{target.id}"] = [
                    bindings[module].get(v.id, f"{module}.{v.id}")
                    for v in node.value.values
                    if isinstance(v, ast.Name)
                ]
    return out


def _callees(fn: ast.FunctionDef, module: str, bound: dict[str, str]) -> set[str]:
    """What `fn` (nested functions included) calls, as dotted names."""
    out = set()
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Subscript):  # REGISTRY[...](...) or module.REGISTRY[...](...)
            f = f.value
        if isinstance(f, ast.Name) and f.id in bound:
            out.add(bound[f.id])
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            if f.value.id in ("plan", "self") and f.attr == "local":
                out.add(f"{CORE}.decode.Plan.local")
            elif f.value.id in bound:
                out.add(f"{bound[f.value.id]}.{f.attr}")
    return out


def checks_on_the_decode_path(
    sources: dict[str, str], programs: list[str], checks: set[str]
) -> tuple[list[list[str]], set[str]]:
    """Call chains from any of `programs` (dotted names) to a function in `checks`, or to
    one whose name starts with `check_`, and every name reached; `sources` maps module
    names to their source."""
    bindings = {m: _bindings(m, s, m.endswith((".core", ".kernels"))) for m, s in sources.items()}
    functions, home = {}, {}
    for m, s in sources.items():
        defs = _functions(m, s)
        functions.update(defs)
        home.update(dict.fromkeys(defs, m))
    registries = _registries(sources, bindings)
    found, seen = [], set()
    stack = [[p] for p in programs]
    while stack:
        chain = stack.pop()
        name = chain[-1]
        if name in seen:
            continue
        seen.add(name)
        if name in checks or name.rsplit(".", 1)[-1].startswith("check_"):
            found.append(chain)
            continue
        targets = registries.get(name, [name])
        for target in targets:
            if target != name:
                stack.append([*chain, target])
                continue
            fn = functions.get(target)
            if fn is not None:
                module = home[target]
                stack += [[*chain, c] for c in _callees(fn, module, bindings[module])]
    return found, seen


def _core_sources() -> dict[str, str]:
    return {m: p.read_text() for m, p in MODULES.items() if m.startswith(CORE)}


def _decode_programs(sources: dict[str, str]) -> list[str]:
    """The jitted programs of `core.decode` (what runs after the door)."""
    tree = ast.parse(sources[f"{CORE}.decode"])
    return [
        f"{CORE}.decode.{n.name}"
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in n.decorator_list)
    ]


CHECKED_AT_THE_DOOR = {  # public forms that check their arguments, besides `check_*`
    f"{CORE}.inputs.resolve_scale",
    f"{CORE}.states.combine",
    f"{CORE}.states.identity_state",
    *(f"{CORE}.kernels.{k}.{k}_state" for k in ("xla", "cudnn", "flash")),
    *(
        f"{CORE}.merges.{m}_combine"
        for m in ("allreduce", "allgather", "reduce_scatter", "all_to_all", "one_pass")
    ),
}


def test_the_decode_path_checks_nothing_twice():
    """Past `make_plan`, the jitted programs of the decoders call no check: no `check_*`,
    no `validate` function, and no public kernel, merge or `combine` (each of which checks
    its arguments again)."""
    sources = _core_sources()
    programs = _decode_programs(sources)
    assert len(programs) >= 5, programs  # _tree, _ring, _pass_q, _energy, _energy_grad
    checks = CHECKED_AT_THE_DOOR | {
        f for f in _functions(f"{CORE}.validate", sources[f"{CORE}.validate"])
    }
    chains, reached = checks_on_the_decode_path(sources, programs, checks)
    assert chains == [], [" -> ".join(c) for c in chains]
    # the walk reaches the kernels, the merges and the fold, through their registries
    assert {
        f"{CORE}.kernels.xla.xla_core",
        f"{CORE}.kernels.cudnn.cudnn_core",
        f"{CORE}.merges.one_pass_core",
        f"{CORE}.merges.allreduce_core",
        f"{CORE}.states.combine_core",
        f"{CORE}.states.lse_weight",
    } <= reached


def test_the_check_finder_can_fail():
    """A program that reaches a check through a registry and a helper is found."""
    sources = _core_sources()
    sources[f"{CORE}.decode"] += (
        "\n\n@jax.jit\ndef _bad(q):\n    return _helper(q)\n\n\ndef _helper(q):\n"
        "    return kernels.KERNELS['xla'](q, q, q)\n"
    )
    chains, _ = checks_on_the_decode_path(sources, [f"{CORE}.decode._bad"], CHECKED_AT_THE_DOOR)
    assert [
        f"{CORE}.decode._bad",
        f"{CORE}.decode._helper",
        f"{CORE}.kernels.KERNELS",
        f"{CORE}.kernels.xla.xla_state",
    ] in chains
