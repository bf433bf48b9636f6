"""The import graph of the core and the plugin, read from their source (no module is imported): no module
imports itself through others, no floor imports a higher one, and the core imports nothing of the plugin.

Every ``import`` and ``from ... import`` in every module of kerple_core/ and kerple_fairseq/ counts, at
the top of a module or inside a function, absolute or relative, and so does ``importlib.import_module`` of
a fixed name or of every module of a package (``f"{__name__}.{name}"`` in its ``__init__``).
``from package import name`` depends on the module ``package.name`` where there is one, else on
``package``. Python also runs a package's ``__init__`` before any of its modules; that dependency is
not counted (every module would otherwise depend on the package's own ``__init__``), and a package's
``__init__`` may import its own modules.
"""

import ast
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Set

CORE, PLUGIN = "kerple_core", "kerple_fairseq"
PACKAGES = (CORE, PLUGIN)
REPO = Path(__file__).resolve().parents[1]

#: the floors, lowest first: a module may import its own floor and those below it, never one above. A
#: module's floor is its package and the first name under it (kerple_core.attention.methods.cope is on
#: ``kerple_core.attention``); a package's own __init__.py is on the floor named by the package alone.
FLOORS = [
    # the core: importing any of it changes nothing in the process
    (f"{CORE}.errors", f"{CORE}.quiet", f"{CORE}.precision"),  # its error type; library notices kept quiet;
    #                                                             the precision computed in
    (f"{CORE}.kernels",),  # the distance kernels
    (f"{CORE}.visibility",),  # which keys each query sees: a layer's window, chunk and cache, said once
    (f"{CORE}.attention",),  # attention with a positional bias (of kernels), and the attention methods
    (f"{CORE}.layer_biases",),  # the biases an attention layer builds for itself, block by block
    #                             (attention.blocks); attention is given them by the model
    #                             (SelfAttentionSetup.layer_bias), never imports them
    (CORE,),  # the core's __init__: fairseq imported quietly
    # the plugin: what fairseq loads for a run
    (f"{PLUGIN}.errors",),  # error wording and one-line reports
    (f"{PLUGIN}.models", f"{PLUGIN}.tasks"),  # the fairseq model and its architectures: what chooses among
    #                                          kernels, layer biases, methods; the plugin's fairseq tasks
    (f"{PLUGIN}.training", f"{PLUGIN}.evaluation"),  # training across processes; evaluating a checkpoint
    (f"{PLUGIN}.analysis",),
    (f"{PLUGIN}.experiments",),
    (f"{PLUGIN}.fairseq_changes",),  # every change to fairseq, made by apply_all
    (PLUGIN,),  # the plugin's __init__: registration, then apply_all
]


class Import(NamedTuple):
    source: str  # the importing module
    target: str  # the imported module
    line: int

    def __str__(self):
        return f"{module_path(self.source)}:{self.line} imports {self.target}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> Dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))
            if "__pycache__" not in p.parts}


MODULES = package_modules()


def module_path(name: str) -> str:
    return str(MODULES[name].relative_to(REPO))


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def floor(name: str) -> str:
    return ".".join(name.split(".")[:2])


def ours(target: str) -> bool:
    return any(target == package or target.startswith(package + ".") for package in PACKAGES)


def imported_names(tree: ast.AST, name: str):
    """``(module name, line)`` for every import in ``tree`` (of module ``name``), outside the
    package too; ``from M import n`` gives ``M.n`` where that is one of the package's modules."""
    package = name if is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                yield (f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module), node.lineno
        elif isinstance(node, ast.Call) and node.args and \
                getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
            what = node.args[0]
            if isinstance(what, ast.Constant) and isinstance(what.value, str):
                yield what.value, node.lineno
            elif isinstance(what, ast.JoinedStr) and is_package(name) and what.values and \
                    isinstance(what.values[0], ast.FormattedValue) and \
                    getattr(what.values[0].value, "id", None) == "__name__":  # every module of this package
                for module in MODULES:
                    if module.rpartition(".")[0] == name:
                        yield module, node.lineno


def import_graph() -> Dict[str, List[Import]]:
    """Each module of the core and the plugin, and its imports of their modules (of itself excepted)."""
    graph = {}
    for name, path in MODULES.items():
        found = imported_names(ast.parse(path.read_text(encoding="utf-8"), str(path)), name)
        graph[name] = sorted({Import(name, target, line) for target, line in found
                              if target != name and ours(target)},
                             key=lambda edge: (edge.line, edge.target))
    return graph


def a_cycle(graph: Dict[str, List[Import]]) -> Optional[List[Import]]:
    """The imports of one cycle of modules, or None when there is none."""
    done: Set[str] = set()
    path: List[Import] = []
    on_path: Dict[str, int] = {}  # module -> its place on the path

    def visit(module: str) -> Optional[List[Import]]:
        on_path[module] = len(path)
        for edge in graph.get(module, ()):
            if edge.target in on_path:
                return path[on_path[edge.target]:] + [edge]
            if edge.target not in done:
                path.append(edge)
                found = visit(edge.target)
                if found:
                    return found
                path.pop()
        del on_path[module]
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            found = visit(module)
            if found:
                return found
    return None


def height(name: str) -> int:
    return next(i for i, names in enumerate(FLOORS) if floor(name) in names)


def test_every_module_is_on_a_floor():
    floors = [name for names in FLOORS for name in names]
    assert len(floors) == len(set(floors)), "a name is on two floors"
    assert {floor(m) for m in MODULES} <= set(floors), \
        f"modules on no floor (add them to FLOORS): {sorted({floor(m) for m in MODULES} - set(floors))}"


def test_every_import_of_the_package_names_one_of_its_modules():
    missing = [str(edge) for edges in import_graph().values() for edge in edges if edge.target not in MODULES]
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)


def test_no_module_imports_itself_through_others():
    graph = {module: [e for e in edges if e.target in MODULES] for module, edges in import_graph().items()}
    cycle = a_cycle(graph)
    assert cycle is None, "an import cycle: " + " -> ".join([cycle[0].source] + [e.target for e in cycle]) + \
        "\n" + "\n".join(str(edge) for edge in cycle)


def test_no_floor_imports_a_higher_one():
    upward = [f"{edge} (floor {floor(edge.source)} imports {floor(edge.target)})"
              for edges in import_graph().values() for edge in edges
              if edge.target in MODULES and height(edge.target) > height(edge.source)]
    assert not upward, "imports from a lower floor of the package up to a higher one:\n" + "\n".join(upward)


def test_the_core_imports_nothing_of_the_plugin():
    """A model of one's own can take the core alone: none of its modules names the plugin."""
    into_plugin = [str(edge) for module, edges in import_graph().items() if floor(module).startswith(CORE)
                   for edge in edges if edge.target.startswith(PLUGIN)]
    assert not into_plugin, "the core imports the plugin:\n" + "\n".join(into_plugin)


def test_the_ground_floors_import_nothing_but_the_cores_error():
    """kerple_core.errors imports nothing; kerple_fairseq.errors words every error of the plugin, takes the
    core's error type, and what it recognises is registered with it."""
    graph = import_graph()
    assert graph[f"{CORE}.errors"] == []
    assert {edge.target for edge in graph[f"{PLUGIN}.errors"]} == {f"{CORE}.errors"}


def test_the_graph_sees_every_kind_of_import():
    """The reader itself: absolute, relative and in-function imports, and a package importing its own
    modules (checked on the packages' modules, whose imports are known)."""
    graph = import_graph()
    targets = {module: {e.target for e in edges} for module, edges in graph.items()}
    assert f"{CORE}.errors" in targets[f"{CORE}.kernels.base"]  # absolute
    assert f"{PLUGIN}.fairseq_changes" in targets[PLUGIN]  # from the package's __init__
    kernel_modules = {m for m in MODULES if m.startswith(f"{CORE}.kernels.")}
    assert kernel_modules <= targets[f"{CORE}.kernels"]  # importlib.import_module(f"{__name__}.{name}")
    tree = ast.parse("from . import base\nfrom ..errors import KernelConfigError\n"
                     "def f():\n    from .registry import registrar\n")
    found = {target for target, _ in imported_names(tree, f"{CORE}.kernels.alibi")}
    assert found == {f"{CORE}.kernels.base", f"{CORE}.errors", f"{CORE}.kernels.registry"}
