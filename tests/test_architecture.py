"""The shape of the house (docs/design.md, "Architecture"): jzero's subpackages are layers, and a
lower layer never imports a higher one; the imports form no cycle; config sits at the bottom (the
package imports no jzero module outside itself); no module or function outgrows one concept; the
public face keeps its names. Imports are read from the source, so a deferred import inside a
function counts like a top-level one. Each rule has a negative control: the checker itself must
report a planted violation."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jzero"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 450, 60

# Bottom to top: a module may import its own layer and the layers before it. The facade
# (`jzero` itself, whose names load lazily from every layer) is for users and the CLI alone.
LAYERS = ("config", "zero", "models", "train", "inference", "tasks", "analysis", "runtime", "cli")
FACADE = "jzero"

# Every name the public face has offered since 0.1 (a new one is added here, none removed).
PUBLIC = {
    "CheckpointError", "CheckpointMismatchError", "CheckpointWarning", "Checkpointer", "Config", "ConfigError",
    "ConfigWarning", "GateSpec", "MoE", "MoESpec", "MoEStats", "NNXMoE", "Plan", "Stages", "TrainState", "Variables",
    "abstract_init", "attention", "device_params", "eval_step", "evaluating", "export", "from_linen", "from_nnx",
    "gather_rows", "init", "load_config", "load_model_state", "load_params", "make_mesh", "row_offset", "scan_layers",
    "train_step", "__version__",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_in(source: str) -> set[str]:
    """The jzero modules ``source`` imports anywhere (``from jzero.x import y`` names the module
    ``jzero.x.y`` when there is one). ``from jzero import __version__`` is a constant, not a
    dependency on the facade; any other name taken from ``jzero`` is."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "jzero"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "jzero":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in MODULES:
                    found.add(sub)
                elif (node.module, alias.name) != (FACADE, "__version__"):
                    found.add(node.module)
    return found


GRAPH = {name: imports_in(path.read_text()) - {name} for name, path in MODULES.items()}


def rank(module: str) -> int:
    """The layer's height; the facade sits with the CLI, above everything it re-exports."""
    return LAYERS.index("cli") if module == FACADE else LAYERS.index(module.split(".")[1])


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points from a lower layer to a higher one."""
    return sorted(f"{m} -> {t}" for m, targets in graph.items() if m != FACADE
                  for t in targets if rank(t) > rank(m))


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


def test_every_module_lives_in_a_layer():
    """The tree is the architecture: no module beside the facade sits outside a layer."""
    stray = sorted(m for m in MODULES if m != FACADE and m.split(".")[1] not in LAYERS)
    assert stray == []
    assert {m.split(".")[1] for m in MODULES if m != FACADE} == set(LAYERS)


def test_no_layer_imports_a_higher_one():
    assert upward(GRAPH) == []


def test_the_layer_check_finds_upward_imports():
    """Negative controls: a planted upward import, and one deferred inside a function."""
    planted = {k: set(v) for k, v in GRAPH.items()}
    planted["jzero.zero.sharding"].add("jzero.train.step")
    assert upward(planted) == ["jzero.zero.sharding -> jzero.train.step"]
    deferred = "def f():\n    from jzero.runtime import checkpoint\n    import jzero\n"
    found = imports_in(deferred)
    assert found == {"jzero.runtime.checkpoint", FACADE}
    assert upward({**GRAPH, "jzero.models.gpt": found}) == [
        "jzero.models.gpt -> jzero", "jzero.models.gpt -> jzero.runtime.checkpoint"]


def test_the_facade_imports_nothing_when_loaded():
    """`jzero` names its modules as strings and loads them on first use (PEP 562)."""
    assert GRAPH[FACADE] == set()


def test_imports_form_no_cycle():
    assert cycles(GRAPH) == []


def test_the_cycle_check_finds_cycles():
    """Negative control: the checker itself reports a planted cycle."""
    planted = {k: set(v) for k, v in GRAPH.items()}
    planted["jzero.config"].add("jzero.zero.optim")
    assert any("jzero.config" in c and "jzero.zero.optim" in c for c in cycles(planted))


def test_config_is_the_bottom_of_the_import_graph():
    """The config package imports no jzero module outside itself: the schema uses its generic
    parser, elasticity's arithmetic and the model, attention and parallel sections, which import no
    jzero module but the parser (the model section the attention one; the data section none)."""
    assert GRAPH["jzero.config"] == {"jzero.config.typed", "jzero.config.elastic", "jzero.config.attention",
                                     "jzero.config.model", "jzero.config.parallel", "jzero.config.data"}
    assert GRAPH["jzero.config.model"] == {"jzero.config.attention"}
    assert GRAPH["jzero.config.parallel"] == {"jzero.config.typed"}
    assert (GRAPH["jzero.config.typed"] == GRAPH["jzero.config.elastic"] == GRAPH["jzero.config.hf"]
            == GRAPH["jzero.config.attention"] == GRAPH["jzero.config.data"] == set())
    assert GRAPH["jzero.config.paramtable"] == {"jzero.config"}
    assert {name for name in MODULES if name.startswith("jzero.config")} == {  # a new module here is checked too
        "jzero.config", "jzero.config.typed", "jzero.config.elastic", "jzero.config.paramtable", "jzero.config.hf",
        "jzero.config.attention", "jzero.config.model", "jzero.config.parallel", "jzero.config.data"}


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_says_what_it_holds_and_may_import(layer):
    doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text()))
    head = doc.split("\n\n")[0]
    assert len(head.splitlines()) <= 3 and "import" in head.lower(), f"jzero/{layer}/__init__.py: {head!r}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_and_function_sizes(name):
    source = MODULES[name].read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES, f"{name}: over {MAX_MODULE_LINES} lines"
    functions = [f for f in ast.walk(ast.parse(source)) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    long = [f"{f.name} ({f.end_lineno - f.lineno + 1} lines)" for f in functions
            if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{name}: functions over {MAX_FUNCTION_LINES} lines: {', '.join(long)}"


def test_every_public_name_imports_from_jzero():
    import jzero

    assert PUBLIC <= set(jzero.__all__)
    for name in sorted(PUBLIC):
        exec(f"from jzero import {name}", {})
    assert callable(jzero.train_step) and isinstance(jzero.__version__, str)


def test_no_public_name_is_shadowed_by_a_submodule():
    """`jzero/__init__` loads public names lazily; a submodule with the same name (jzero.export
    and the function export once) would replace the function with the module once imported."""
    import jzero

    submodules = {name.split(".")[1] for name in MODULES if name.count(".") >= 1}
    assert not set(jzero.__all__) & submodules
    for name in jzero.__all__:
        assert getattr(jzero, name) is not None
    assert callable(jzero.export) and callable(jzero.load_params)
