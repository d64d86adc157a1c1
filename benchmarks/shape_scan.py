"""The codebase's shape, by stdlib ast scans of a source tree: what the shape-and-docs work measures, so the
next round can rerun it and compare.

    python benchmarks/shape_scan.py [TREE]      # TREE: a checkout (default: this repository)

Prints one figure per line: the trainer's size, the CLI's files and function-level imports, classes over
250 lines, functions over 60 lines, module names used twice, import cycles between modules (lazy imports
included), two-way package pairs, lines of README/docs/paratrain pointing outside the repository, and the
length of docs/benchmarks.md. The package's own module names are found by walking TREE/paratrain.
"""

from __future__ import annotations

import argparse
import ast
import collections
import re
import sys
from pathlib import Path

OUTSIDE = re.compile(
    r"(^|[\s`'\"(=])/(work|home|root|tmp|mnt|scratch|Users)/|\.\./shared|shared/(seeds|REFERENCE|STYLE)"
)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_edges(root: Path, files: list[Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in the file (lazy and TYPE_CHECKING included)."""
    modules = {module_name(root, path) for path in files}
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for path in files:
        me = module_name(root, path)
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _targets(node, me, is_package=path.name == "__init__.py"):
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != me and target != "paratrain" and not me.startswith(target + "."):
                    edges[me].add(target)
    return edges


def _targets(node: ast.AST, me: str, *, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = me.split(".") if is_package else me.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, a package and its own children aside."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for following in edges.get(node, ()):
            if following not in index:
                visit(following)
                low[node] = min(low[node], low[following])
            elif following in on_stack:
                low[node] = min(low[node], index[following])
        if low[node] == index[node]:
            component = []
            while True:
                popped = stack.pop()
                on_stack.discard(popped)
                component.append(popped)
                if popped == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for node in list(edges):
        if node not in index:
            visit(node)
    return [
        c
        for c in found
        if not all(any(o != m and (o.startswith(m + ".") or m.startswith(o + ".")) for o in c) for m in c)
    ]


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def function_level_imports(tree: ast.Module) -> int:
    return sum(
        isinstance(node, (ast.Import, ast.ImportFrom))
        for function in ast.walk(tree)
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(function)
    )


def scan(tree: Path) -> list[str]:
    package = tree / "paratrain"
    files = sorted(package.rglob("*.py"))
    parsed = {path: ast.parse(path.read_text()) for path in files}
    edges = import_edges(tree, files)
    lines = []
    trainer = next(
        (path, node)
        for path, t in parsed.items()
        for node in ast.walk(t)
        if isinstance(node, ast.ClassDef) and node.name == "Trainer"
    )
    path, node = trainer
    methods = [m.name for m in node.body if isinstance(m, ast.FunctionDef) and m.name != "__init__"]
    imports = {
        (n.level, n.module)
        for n in ast.walk(parsed[path])
        if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("paratrain"))
    }
    lines.append(
        f"trainer: {path.relative_to(tree)} {len(path.read_text().splitlines())} lines, class {node.end_lineno - node.lineno + 1} lines, {len(methods)} methods, {len(imports)} paratrain imports, named for replicas/healing: {[m for m in methods if re.search('replica|heal', m)]}"
    )
    cli = [p for p in files if p.name == "cli.py" or "cli" in p.relative_to(package).parts[:-1]]
    lines.append(
        f"cli: {len(cli)} files, largest {max(len(p.read_text().splitlines()) for p in cli)} lines, {sum(function_level_imports(parsed[p]) for p in cli)} function-level imports"
    )
    big_classes = [
        f"{p.relative_to(tree)}:{n.name} {n.end_lineno - n.lineno + 1}"
        for p, t in parsed.items()
        for n in ast.walk(t)
        if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > 250
    ]
    lines.append(f"classes over 250 lines: {len(big_classes)} {big_classes}")
    long_functions = [
        f"{p.relative_to(tree)}:{n.name}"
        for p, t in parsed.items()
        for n in ast.walk(t)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60
    ]
    lines.append(f"functions over 60 lines: {len(long_functions)} {long_functions}")
    big_files = [
        f"{p.relative_to(tree)} {len(p.read_text().splitlines())}"
        for p in files
        if len(p.read_text().splitlines()) > 300
    ]
    lines.append(f"files over 300 lines: {len(big_files)} {big_files}")
    names = collections.Counter(p.name for p in files if p.name not in ("__init__.py", "base.py"))
    lines.append(f"module names used twice: {sorted(n for n, k in names.items() if k > 1)}")
    lines.append(f"import cycles between modules (lazy imports included): {cycles(edges)}")
    pairs = {
        tuple(sorted((package_of(a), package_of(b))))
        for a, targets in edges.items()
        for b in targets
        if package_of(a) != package_of(b)
    }
    two_way = sorted(
        p
        for p in pairs
        if any(package_of(a) == p[1] and any(package_of(b) == p[0] for b in edges[a]) for a in edges)
        and any(package_of(a) == p[0] and any(package_of(b) == p[1] for b in edges[a]) for a in edges)
    )
    lines.append(f"two-way package pairs: {len(two_way)} {two_way}")
    docs = [tree / "README.md", *sorted((tree / "docs").rglob("*.md")), *files]
    outside = [
        f"{p.relative_to(tree)}:{i}"
        for p in docs
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    lines.append(f"lines pointing outside the repository: {len(outside)} {outside[:5]}")
    bench = tree / "docs" / "benchmarks.md"
    lines.append(f"docs/benchmarks.md: {len(bench.read_text().splitlines()) if bench.exists() else 0} lines")
    lines.append(f"package root modules: {len(list(package.glob('*.py')))}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    for line in scan(Path(parser.parse_args().tree)):
        print(line)


if __name__ == "__main__":
    main()
