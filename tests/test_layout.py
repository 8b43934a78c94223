"""The code's shape, as a newcomer relies on it: the dumper never imports the analyzer, the
analyzer never an inference engine, no module imports itself back through others (lazy imports
inside functions count), and the analyzer's layers depend one way only."""

from __future__ import annotations

import ast
import os

from helpers import ROOT

PACKAGES = {"dumper": "dumpdiff.dumper", "analyzer": "dumpdiff.analyzer"}
ENGINES = {"sglang", "vllm", "sgl_kernel"}  # (transformers is a model library: `repro --model` loads one)
# What the analyzer may import from the dumper: the dump format, and the row fingerprint both
# sides must compute alike (pure torch, no hooks).
SHARED_WITH_THE_ANALYZER = ("dumpdiff.dumper.format", "dumpdiff.dumper.rowprint")
# Each layer of the analyzer may import only the layers before it (and the shared top-level
# modules: errors, http, wording).
LAYERS = ["dump", "index", "verdict", "report", "kl", "cli"]


def _modules():
    """Module name -> (path, names it imports, resolved to absolute module or package names)."""
    found = {}
    for folder, package in PACKAGES.items():
        for where, _, files in os.walk(os.path.join(ROOT, folder)):
            for file in (f for f in files if f.endswith(".py")):
                path = os.path.join(where, file)
                parts = [package, *os.path.relpath(path, os.path.join(ROOT, folder))[:-3].split(os.sep)]
                is_package = parts[-1] == "__init__"
                name = ".".join(parts[:-1] if is_package else parts)
                found[name] = (path, _imports(path, name, is_package))
    return found


def _imports(path: str, name: str, is_package: bool):
    names = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            names.add(module)
            names |= {f"{module}.{a.name}" for a in node.names}  # `from . import x`: x may be a module
    return names


def _graph():
    modules = _modules()
    # A module's parent packages are imported before it whatever it says: not a dependency.
    return modules, {
        m: {n for n in imports if n in modules and not m.startswith(n)} for m, (_, imports) in modules.items()
    }


def test_the_dumper_never_imports_the_analyzer_nor_the_analyzer_an_engine():
    modules, _ = _graph()
    wrong = []
    for name, (path, imports) in modules.items():
        roots = {i.split(".")[0] for i in imports}
        if name.startswith("dumpdiff.dumper") and any(i.startswith("dumpdiff.analyzer") for i in imports):
            wrong.append(f"{path} imports the analyzer")
        if name.startswith("dumpdiff.analyzer") and roots & ENGINES:
            wrong.append(f"{path} imports {sorted(roots & ENGINES)}")
        if name.startswith("dumpdiff.analyzer") and any(
            i.startswith("dumpdiff.dumper.") and not i.startswith(SHARED_WITH_THE_ANALYZER) for i in imports
        ):
            wrong.append(f"{path} imports dumper code other than {SHARED_WITH_THE_ANALYZER}")
    assert wrong == []


def test_no_import_cycles():
    _, graph = _graph()
    # Tarjan's strongly connected components: any of more than one module is a cycle.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_analyzer_layers_depend_one_way():
    _, graph = _graph()
    wrong = []
    for name, deps in graph.items():
        layer = name.split(".")[2] if name.count(".") >= 2 else None
        if layer not in LAYERS:
            continue
        for dep in deps:
            dep_layer = dep.split(".")[2] if dep.count(".") >= 2 and dep.startswith("dumpdiff.analyzer") else None
            if dep_layer in LAYERS and LAYERS.index(dep_layer) > LAYERS.index(layer):
                wrong.append(f"{name} ({layer}) imports {dep} ({dep_layer})")
    assert wrong == []


def test_every_analyzer_sub_package_says_what_it_owns():
    missing = [
        layer
        for layer in LAYERS
        if not ast.get_docstring(ast.parse(open(os.path.join(ROOT, "analyzer", layer, "__init__.py")).read()))
    ]
    assert missing == []
