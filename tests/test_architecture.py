"""The shape of the house (docs/design.md, "Architecture"): jzero's imports form no cycle, config
sits at the bottom (the package imports no jzero module outside itself, at top level or inside a function), and no
module or function outgrows one concept. Imports are read from the source, so a deferred
import inside a function counts like a top-level one."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jzero"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 450, 60


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path) -> set[str]:
    """The jzero modules ``path`` imports anywhere in its source (``from jzero import x`` names
    the module ``jzero.x`` when there is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "jzero"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "jzero":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


GRAPH = {name: imports_of(path) - {name} for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_imports_form_no_cycle():
    assert cycles(GRAPH) == []


def test_config_is_the_bottom_of_the_import_graph():
    """The config package imports no jzero module outside itself: the schema uses its generic
    parser and elasticity's arithmetic, which import no jzero module at all."""
    assert GRAPH["jzero.config"] == {"jzero.config.typed", "jzero.config.elastic"}
    assert GRAPH["jzero.config.typed"] == set() and GRAPH["jzero.config.elastic"] == set()
    assert {name for name in MODULES if name.startswith("jzero.config")} == {
        "jzero.config", "jzero.config.typed", "jzero.config.elastic"}  # a new module here is checked too


def test_the_cycle_check_finds_cycles():
    """Negative control: the checker itself reports a planted cycle."""
    planted = {k: set(v) for k, v in GRAPH.items()}
    planted["jzero.config"].add("jzero.optim")
    assert any("jzero.config" in c and "jzero.optim" in c for c in cycles(planted))


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_and_function_sizes(name):
    source = MODULES[name].read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES, f"{name}: over {MAX_MODULE_LINES} lines"
    functions = [f for f in ast.walk(ast.parse(source)) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    long = [f"{f.name} ({f.end_lineno - f.lineno + 1} lines)" for f in functions
            if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{name}: functions over {MAX_FUNCTION_LINES} lines: {', '.join(long)}"


def test_no_public_name_is_shadowed_by_a_submodule():
    """`jzero/__init__` loads public names lazily; a submodule with the same name (jzero.export
    and the function export once) would replace the function with the module once imported."""
    import jzero

    submodules = {name.split(".")[1] for name in MODULES if name.count(".") >= 1}
    assert not set(jzero.__all__) & submodules
    for name in jzero.__all__:
        assert getattr(jzero, name) is not None
    assert callable(jzero.export) and callable(jzero.load_params)
