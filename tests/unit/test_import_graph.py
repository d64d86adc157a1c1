"""The layering rules of docs/architecture.md, read from the source with the stdlib ast module: the
packages in one order (each imports only those below it: no two-way pairs, no circles), no import cycles
between modules, nothing on the training path reaching tools/, and imports inside functions only where a
comment says they are deliberately lazy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "paratrain"
TRAINING_ENTRIES = ("paratrain.train", "paratrain.training.trainer")

# paratrain's top-level packages and modules, bottom to top: each may import only those before it (and
# its own modules). Every import counts: module-level, under TYPE_CHECKING, and lazy inside a function.
# A new package is placed here where it belongs; docs/architecture.md explains the order.
LAYERS = (
    # leaves: no paratrain imports beyond errors
    "errors",
    "tensors",
    "losses",
    "precision",
    "gradients",
    "cuda_settings",
    "files",
    # the typed config tree: schema, loading, reference docs, factories
    "config",
    # models and their plans as data; then the layouts' transforms, meshes and collectives
    "models",
    "parallel",
    # what runs a step, and the units the loop uses (each takes its own config section)
    "engine",
    "nonfinite",
    "launch",
    "data",
    "checkpoint",
    "tracking",
    "optim",
    "evaluation",
    "debug",
    "callbacks",
    "layout",
    # whole-config checks, above everything they check; the planner, which uses them
    "checks",
    "planner",
    # what a rank trains, built in the trainer's order (process, data, laid-out model), and the loop
    "training",
    # the per-rank entry, the tools, the command line, the public API
    "train",
    "worker",
    "tools",
    "cli",
    "paratrain",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in MODULES.items()}


def imported(node: ast.Import | ast.ImportFrom, importer: str) -> list[tuple[str, str | None]]:
    """(module, name) pairs of one import statement, relative imports resolved."""
    if isinstance(node, ast.Import):
        return [(alias.name, None) for alias in node.names]
    base = node.module or ""
    if node.level:
        package = importer.split(".")
        if MODULES[importer].name != "__init__.py":
            package = package[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    return [(base, alias.name) for alias in node.names]


def is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported (try/if bodies included, TYPE_CHECKING blocks not)."""
    found, stack = [], list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and not is_type_checking(node):
            stack.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            stack.extend(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
    return found


def targets(importer: str, node) -> set[str]:
    """The paratrain modules an import statement loads (``from pkg import module`` counts the module)."""
    loaded = set()
    for module, name in imported(node, importer):
        if name and f"{module}.{name}" in MODULES:
            loaded.add(f"{module}.{name}")
        elif module in MODULES:
            loaded.add(module)
    return loaded


GRAPH = {
    name: set().union(*(targets(name, node) for node in module_level_imports(tree))) for name, tree in TREES.items()
}
# Every import, lazy ones inside functions and TYPE_CHECKING ones included: a circle closed by a lazy import is
# still two modules that each need the other.
EVERY_IMPORT = {
    name: set().union(
        *(targets(name, node) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))
    )
    for name, tree in TREES.items()
}


def cycle_through(start: str, graph: dict[str, set[str]] = EVERY_IMPORT) -> list[str] | None:
    path, seen = [start], set()

    def visit(node: str) -> list[str] | None:
        for following in sorted(graph[node]):
            if following == start:
                return [*path, start]
            if following not in seen:
                seen.add(following)
                path.append(following)
                if found := visit(following):
                    return found
                path.pop()
        return None

    return visit(start)


def test_the_package_has_no_import_cycles_lazy_imports_included():
    cycles = {" -> ".join(cycle) for name in MODULES if (cycle := cycle_through(name))}
    assert cycles == set()


def imports_of(package: str) -> list[tuple[str, str, str | None]]:
    """(importer, module, name) for every import anywhere in the modules under ``package``."""
    found = []
    for importer, tree in TREES.items():
        if importer == package or importer.startswith(package + "."):
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found += [(importer, module, name) for module, name in imported(node, importer)]
    return found


def package_of(module: str) -> str:
    """``paratrain.checks.preflight`` -> ``checks``; the root package itself is ``paratrain``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def import_kind(tree: ast.Module, node: ast.stmt) -> str:
    if node in module_level_imports(tree):
        return "module-level"
    if any(isinstance(block, ast.If) and is_type_checking(block) and node in ast.walk(block) for block in tree.body):
        return "under TYPE_CHECKING"
    return "inside a function"


def all_imports() -> list[tuple[str, str, str, int]]:
    """(importer, imported module, kind, line) for every paratrain import anywhere in paratrain."""
    found = []
    for importer, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                kind = import_kind(tree, node)
                found += [(importer, target, kind, node.lineno) for target in sorted(targets(importer, node))]
    return found


def layering_violations(imports: list[tuple[str, str, str, int]]) -> list[str]:
    """Each import that points up LAYERS (or at a package LAYERS does not place), as one sentence."""
    rank = {name: index for index, name in enumerate(LAYERS)}
    found = []
    for importer, target, kind, line in imports:
        low, high = package_of(importer), package_of(target)
        if low == high:
            continue
        if low not in rank or high not in rank:
            unplaced = low if low not in rank else high
            found.append(f"{importer} imports {target}: package {unplaced!r} has no place in LAYERS; add it")
        elif rank[high] > rank[low]:
            found.append(
                f"{importer} (line {line}, {kind}) imports {target}: {high!r} is above {low!r} in LAYERS, and a "
                f"package imports only the packages below it; move what both need down, or pass it in"
            )
    return found


def test_every_import_points_down_the_layers():
    violations = layering_violations(all_imports())
    assert not violations, "\n".join(violations)


def test_every_package_has_a_place_in_the_layers():
    packages = {package_of(name) for name in MODULES}
    assert sorted(packages - set(LAYERS)) == [] and sorted(set(LAYERS) - packages) == []


def test_parallel_imports_no_trainer_data_or_root_config():
    forbidden = [
        (importer, module, name)
        for importer, module, name in imports_of("paratrain.parallel")
        if module.startswith(("paratrain.training.trainer", "paratrain.data"))
        or (module == "paratrain.config.schema" and name == "Config")
        or (module == "paratrain.config" and name in ("Config", "schema"))
    ]
    assert forbidden == []


def test_models_import_nothing_from_parallel():
    """Models declare their plan (paratrain.models.plan_derivation); they never reach into the layouts."""
    assert [entry for entry in imports_of("paratrain.models") if entry[1].startswith("paratrain.parallel")] == []


def test_the_training_path_does_not_load_tools():
    loaded, todo = set(), list(TRAINING_ENTRIES)
    while todo:
        name = todo.pop()
        if name not in loaded:
            loaded.add(name)
            todo.extend(GRAPH[name])
    assert sorted(name for name in loaded if name.startswith("paratrain.tools")) == []


def function_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    found = []
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [node for node in ast.walk(function) if isinstance(node, (ast.Import, ast.ImportFrom))]
    return found


def says_lazy(lines: list[str], node: ast.stmt) -> bool:
    """A comment on the import's line, or within the four lines above it (one comment may cover a short
    group of imports), that says why it is lazy."""
    nearby = " ".join(lines[max(0, node.lineno - 5) : node.end_lineno]).lower()
    return "#" in nearby and "lazy" in nearby


def unexplained_function_level_imports() -> set[str]:
    found = set()
    for name, tree in TREES.items():
        lines = MODULES[name].read_text().splitlines()
        found |= {
            f"{MODULES[name].relative_to(PACKAGE.parent)}: {ast.unparse(node)}"
            for node in function_level_imports(tree)
            if not says_lazy(lines, node)
        }
    return found


def test_function_level_imports_say_why_they_are_lazy():
    assert sorted(unexplained_function_level_imports()) == [], "import at module level, or comment why it is lazy"


def test_the_rules_see_what_they_check():
    """The parsing finds the imports the rules are about (so an empty result means something)."""
    assert "paratrain.parallel.dims" in GRAPH["paratrain.parallel.parallelize"]
    assert ("paratrain.parallel.dims", "paratrain.config.schema", "ParallelConfig") in imports_of("paratrain.parallel")
    assert any(entry[1] == "paratrain.models.plan_derivation" for entry in imports_of("paratrain.models"))
    assert "paratrain.parallel.parallelize" in GRAPH["paratrain.layout.flat"]
    kinds = {(importer, target): kind for importer, target, kind, _ in all_imports()}
    assert kinds["paratrain.callbacks.base", "paratrain.checkpoint.state"] == "under TYPE_CHECKING"
    assert kinds["paratrain.layout", "paratrain.layout.pipelined"] == "inside a function"
    assert "paratrain.layout.pipelined" in EVERY_IMPORT["paratrain.layout"]  # lazy imports count for cycles
    planted = ("paratrain.parallel.dims", "paratrain.engine", "under TYPE_CHECKING", 1)  # a back-edge must be found
    assert layering_violations([planted]) == [
        "paratrain.parallel.dims (line 1, under TYPE_CHECKING) imports paratrain.engine: 'engine' is above "
        "'parallel' in LAYERS, and a package imports only the packages below it; move what both need down, or "
        "pass it in"
    ]
    EVERY_IMPORT["paratrain.errors"].add("paratrain.training.trainer")  # a planted cycle must be found
    try:
        assert cycle_through("paratrain.errors")
    finally:
        EVERY_IMPORT["paratrain.errors"].discard("paratrain.training.trainer")


def test_the_launcher_checks_a_config_without_loading_dtensor():
    """`paratrain train` builds the model on meta in preflight before it launches; DTensor (with sympy) is the
    workers' to load: importing it there took a quarter of the launcher's start-up (docs/benchmarks.md)."""
    check = (
        "import sys\n"
        "from paratrain.checks.preflight import preflight\n"
        "from paratrain.config.loading import load_config\n"
        "for example in ('examples/quickstart.yaml', 'examples/gpt_moe.yaml'):\n"
        "    preflight(load_config(example, []), world_size=2, nproc_per_node=2)\n"
        "print(sorted(name for name in sys.modules if name.startswith('torch.distributed.tensor')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=PACKAGE.parent, check=True, timeout=300
    )
    assert result.stdout.strip() == "[]", result.stdout
