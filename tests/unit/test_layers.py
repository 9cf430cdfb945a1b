"""The package's layer order and its import graph, read with ast (nothing is imported, so it is fast
and sees imports inside functions too): data flows up the layers, never down, and no module
imports itself back through others."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.stack import ROOT

PACKAGE = ROOT / "frenzy_prefect"


# The package's components, lowest first: its top-level modules and packages, and a package's
# module named on its own where it belongs to a later layer than its package (storage's
# prefect-aws credentials are the shell's). A module may import its own layer's and lower layers'
# components, never a later layer's.
LAYERS: list[set[str]] = [
    {"units", "errors"},
    {"caching_allocator"},  # PyTorch's CUDA caching allocator's rules, replayed: memory models with it, training traces for it
    {"storage"},  # object storage: below the profilers and the trainer that read and write it
    {"spec"},
    {"profiling"},
    {"datasets"},  # raw text to token shards (it reads manifests as profiling does)
    {"memory"},
    {"allocator"},
    {"pipeline"},  # schedules as data (torch-free): the engine executes them, ReCycle plans them
    {"torch_private"},  # the private torch APIs the trainer uses, each checked (tests/unit/test_private_apis.py)
    {"training", "launch", "scheduling", "recycle"},  # the rest of the core
    # The Prefect shell.
    {"prefect_private"},  # the private Prefect APIs the shell uses, each checked (tests/unit/test_private_apis.py)
    {"blocks", "storage.credentials"},
    {"pool"},  # the `frenzy` work pool: its worker, GPU queue and leases
    {"flows"},  # the flows, their tasks and deployments (tasks read free GPUs through the pool's leases)
    {"localstack", "collection"},
    {"cli"},
]


# Allowed by the layers, but not wanted: the executor does not depend on its own memory model
# (the plan's layout both use is spec.layout).
FORBIDDEN = [("training", "memory")]


# Packages that must run without torch or Prefect installed, with everything they import.
PURE = ["pipeline", "datasets"]


HEAVY = ("torch", "prefect", "deepspeed")


# Modules, within a layer that may use torch, that must not: the Slurm launcher's watcher and its
# nodes' side (started before any rank, on every node and for every run) and its inventory.
LIGHT = ["frenzy_prefect.launch.slurm", "frenzy_prefect.launch.slurm_job", "frenzy_prefect.launch.slurm_inventory"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _import_graph() -> dict[str, set[str]]:
    """Module -> the frenzy_prefect modules it imports, at the top or anywhere inside it.
    ``from package import name`` points at ``package.name`` when that is a module."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.add(sub if sub in modules else source)
        graph[name] = {t for t in targets if t in modules and t != "frenzy_prefect" and t != name}
    return graph


def _component(module: str) -> str:
    """The most specific component of LAYERS that holds ``module`` (``frenzy_prefect.x.y...``)."""
    parts = module.split(".")[1:]
    named = set().union(*LAYERS)
    return next(".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in named or n == 1)


def _external_imports(path: Path) -> set[str]:
    """The top-level names of what a module imports from outside frenzy_prefect."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def _heavy_imports(roots: set[str]) -> list[str]:
    """What ``roots``, and everything of the package they import, import of HEAVY."""
    graph, modules = _import_graph(), _modules()
    seen = set(roots)
    todo = list(seen)
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return sorted(f"{m} imports {name}" for m in seen for name in _external_imports(modules[m]) if name in HEAVY)


def test_the_pure_packages_import_neither_torch_nor_prefect():
    assert _heavy_imports({m for m in _modules() if m != "frenzy_prefect" and _component(m) in PURE}) == []


def test_the_slurm_launchers_light_modules_import_neither_torch_nor_prefect():
    assert set(LIGHT) <= set(_modules())
    assert _heavy_imports(set(LIGHT)) == []


def test_every_top_level_module_has_a_layer():
    components = {_component(m) for m in _modules() if m != "frenzy_prefect"}
    placed = set().union(*LAYERS)
    assert components - placed == set(), "put these in LAYERS"
    assert placed - components == set(), "LAYERS names modules that do not exist"
    assert sum(len(layer) for layer in LAYERS) == len(placed), "a module is in two layers"


def test_no_module_imports_a_later_layer():
    layer_of = {c: i for i, layer in enumerate(LAYERS) for c in layer}
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in _import_graph().items()
        if module != "frenzy_prefect"
        for target in targets
        if layer_of[_component(target)] > layer_of[_component(module)]
    )
    assert upward == []


def test_no_forbidden_imports():
    found = sorted(
        f"{module} imports {target}"
        for module, targets in _import_graph().items()
        if module != "frenzy_prefect"
        for target in targets
        if (_component(module), _component(target)) in FORBIDDEN
    )
    assert found == []


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_no_import_cycles_between_modules():
    assert _cycle(_import_graph()) is None


def test_no_import_cycles_between_top_level_packages():
    packages: dict[str, set[str]] = {}
    for module, targets in _import_graph().items():
        if module != "frenzy_prefect":
            packages.setdefault(_component(module), set()).update(_component(t) for t in targets if _component(t) != _component(module))
    assert _cycle(packages) is None


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
