"""The package's import graph: no circles, and dependencies point the way docs/layout.md says.

Every module of hf_dspark is parsed with ``ast`` (none is run for the graph), and every ``import`` / ``from ... import``
of an hf_dspark module becomes an edge, at module level and inside functions alike: a function-level import that
closes a circle is still a circle, only deferred. Lazy imports are fine where they point down or sideways (cli
loading a job, a job loading the target), so the layer rule holds for both kinds. Imports under
``if TYPE_CHECKING:`` never run and are left out. The drafter folders under ``drafters/`` are skipped: one written there
(``scripts/package_drafter.py``) holds git-ignored copies of the model files, whose relative imports name those copies.
"""

from __future__ import annotations

import ast
from pathlib import Path

from hf_dspark.drafter_files import module_closure

PACKAGE = Path(__file__).resolve().parents[1] / "hf_dspark"

# docs/layout.md, "Direction of dependencies": model <- generation <- engine <- jobs <- cli (prefixes of module names).
LAYERS = {
    "model": ["configuration_dspark", "modeling_dspark", "heads", "draft_sampling", "static_round", "drafter_files",
              "rollback", "clock", "stats", "draft_sources", "gate", "budget", "scheduling", "planner", "block_source",
              "token_tree", "tree_round", "verification_width", "setting_choices",
              "policy_names", "attention", "kernels"],
    "generation": ["hf_dspark", "generation", "profiling", "target", "defaults", "prompts", "allocator", "onednn",
                   "optimization", "machine_load", "cpu_features"],
    "engine": ["engine"],
    "jobs": ["training", "calibration", "evaluation", "hub", "export", "demo", "serving"],
    "cli": ["cli"],
}
ORDER = list(LAYERS)
# What a drafter folder carries (the modules the model file and the generation module import, followed through):
# at module level these import only each other (docs/layout.md).
REMOTE_CODE = {f"hf_dspark.{path.stem}" for entry in ("modeling_dspark.py", "generation.py")
               for path in module_closure(PACKAGE / entry)}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[0] == "drafters":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(("hf_dspark", *parts))] = path
    return modules


MODULES = _modules()


def _type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:``: imports for annotations only, never executed."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, annotations: bool = False) -> list[tuple[str, int, bool]]:
    """``(imported module, line, at module level)`` for each hf_dspark module ``name`` imports (``annotations``: the
    imports under ``if TYPE_CHECKING:`` too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module or ""
                # `from package import module` imports the module; `from module import name` the module itself
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in child.names]
            elif isinstance(child, ast.If) and _type_checking(child.test):
                body = child.orelse + (child.body if annotations else [])  # the block itself never runs
                visit(ast.Module(body=body, type_ignores=[]), module_level)
                continue
            else:
                inner = module_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(child, inner)
                continue
            for target in targets:
                while target and target not in MODULES:  # `import hf_dspark.x.y` of a name inside a module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.append((target, child.lineno, module_level))

    visit(ast.parse(path.read_text(encoding="utf-8")), True)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    for layer, prefixes in LAYERS.items():
        if module == "hf_dspark" and "hf_dspark" in prefixes:
            return layer
        if len(parts) > 1 and parts[1] in prefixes:
            return layer
    raise AssertionError(f"{module} is in no layer: add it to LAYERS here and to docs/layout.md")


def _cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path whose first and last entries agree, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


def _where(a: str, b: str) -> str:
    return ", ".join(f"{MODULES[a].relative_to(PACKAGE.parent)}:{line}{'' if top else ' (in a function)'}"
                     for line, top in sorted({(line, top) for target, line, top in GRAPH[a] if target == b}))


def test_cycle_finder_finds_cycles():
    assert _cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert _cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None
    groups = _strongly_connected({"a": ["b"], "b": ["a", "c"], "c": ["d"], "d": ["c"], "e": ["a"]})
    assert sorted(map(sorted, groups)) == [["a", "b"], ["c", "d"], ["e"]]


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def _strongly_connected(graph: dict[str, list[str]]) -> list[set[str]]:
    """The groups of modules that reach each other (Kosaraju); a group of two or more holds a circle."""
    order, seen = [], set()

    def forward(node):
        seen.add(node)
        for nxt in graph.get(node, []):
            if nxt not in seen:
                forward(nxt)
        order.append(node)

    for node in sorted(graph):
        if node not in seen:
            forward(node)
    reverse = {node: [a for a in graph if node in graph[a]] for node in graph}
    groups, assigned = [], set()
    for node in reversed(order):
        if node in assigned:
            continue
        group, stack = set(), [node]
        while stack:
            current = stack.pop()
            if current not in assigned:
                assigned.add(current)
                group.add(current)
                stack.extend(reverse[current])
        groups.append(group)
    return groups


def test_no_import_cycles():
    """Module- and function-level imports together form no circle; every circle is listed with its import lines."""
    report = _cycles(GRAPH)
    assert not report, report


def test_no_import_cycles_through_annotations():
    """Nor do they with the imports made for annotations only (``if TYPE_CHECKING:``): two modules that need each
    other's names, even only to annotate, share a piece that belongs in a third."""
    report = _cycles({name: _imports(name, path, annotations=True) for name, path in MODULES.items()})
    assert not report, report


def _cycles(edges_by_module: dict[str, list[tuple[str, int, bool]]]) -> str:
    """Every circle of the import graph with its import lines ("" when there is none)."""
    graph = {a: sorted({b for b, _, _ in edges}) for a, edges in edges_by_module.items()}
    report = []
    for group in _strongly_connected(graph):
        if len(group) > 1:
            cycle = _cycle({a: [b for b in graph[a] if b in group] for a in group})
            report.append(" -> ".join(cycle) + "\n" + "\n".join(f"  {a} -> {b}: {_where(a, b)}"
                                                                for a, b in zip(cycle, cycle[1:])))
    return "import cycles:\n" + "\n".join(report) if report else ""


def test_imports_follow_the_layers():
    """model <- generation <- engine <- jobs <- cli: no module imports a layer to its right, lazily or not."""
    wrong = [f"{a} ({_layer(a)}) imports {b} ({_layer(b)}) at {_where(a, b)}"
             for a, edges in GRAPH.items() for b in sorted({b for b, _, _ in edges})
             if ORDER.index(_layer(b)) > ORDER.index(_layer(a))]
    assert not wrong, "imports against docs/layout.md:\n" + "\n".join(wrong)


def test_remote_code_files_import_only_each_other():
    wrong = [f"{a} imports {b} at {_where(a, b)}" for a in sorted(REMOTE_CODE)
             for b, _, top in GRAPH[a] if top and b not in REMOTE_CODE]
    assert not wrong, "a drafter folder carries only these files:\n" + "\n".join(wrong)
