"""The import graph of the ``kvlab`` package: module sizes, kvlab-internal imports, cycles, largest module.

Usage: ``python benchmarks/import_graph.py [--edges] [--top N] [--root DIR]``. Reads the source only (nothing is
imported). An edge ``a -> b`` means module ``a`` imports ``b`` at run time, at module level or inside a
function (a lazy import is still an import: a cycle it closes is a cycle). ``from pkg import name``
points at ``pkg.name`` when that is a module, else at ``pkg``. Imports under ``if TYPE_CHECKING:`` are not
run and are listed apart. A package ``__init__`` that imports every submodule with
``importlib.import_module(f"{__name__}.…")`` (the policy registry) gets an edge to each of them.
Importing ``a.b`` also runs ``a/__init__``; that implicit edge is left out (a package importing its own
submodules is not a cycle). Cycles are the strongly connected components of more than one module (Tarjan).
Exit status 1 when there is a cycle.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "kvlab"


@dataclass
class Module:
    """One module of the package: its dotted name, file, line count and the imports found in it."""

    name: str
    path: Path
    lines: int
    is_package: bool
    imports: dict[str, str] = field(default_factory=dict)  # target -> "top" | "lazy" (top wins)
    type_only: set[str] = field(default_factory=set)


def discover(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Module]:
    """Every ``.py`` file under ``root/package`` as a :class:`Module` (imports not yet read)."""
    mods: dict[str, Module] = {}
    for path in sorted((root / package).rglob("*.py")):
        if "__pycache__" in path.parts:  # generated kernel modules (kvlab.cache.compiled), not the package's
            continue
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        name = ".".join(parts)
        mods[name] = Module(name, path, len(path.read_text().splitlines()), is_pkg)
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(mod: Module, node: ast.ImportFrom) -> str:
    """The absolute module a (possibly relative) ``from … import`` names."""
    if not node.level:
        return node.module or ""
    base = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def read_imports(mod: Module, mods: dict[str, Module]) -> None:
    """Fill ``mod.imports`` / ``mod.type_only`` with the package-internal modules ``mod`` imports."""
    tree = ast.parse(mod.path.read_text(), filename=str(mod.path))

    def add(target: str, lazy: bool, type_only: bool) -> None:
        while target and target not in mods:  # ``import kvlab.x.y.z`` of a name: its nearest module
            target = target.rpartition(".")[0]
        if not target.startswith(PACKAGE) or target == mod.name:
            return
        if type_only:
            mod.type_only.add(target)
        elif mod.imports.get(target) != "top":
            mod.imports[target] = "lazy" if lazy else "top"

    def visit(node: ast.AST, lazy: bool, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, lazy, True)
            for child in node.orelse:
                visit(child, lazy, type_only)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, lazy, type_only)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in mods else base, lazy, type_only)
        elif isinstance(node, ast.Call) and mod.is_package and _imports_every_submodule(node):
            for other in mods:
                if other.rpartition(".")[0] == mod.name:
                    add(other, lazy, type_only)
        inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner, type_only)

    visit(tree, False, False)


def _imports_every_submodule(call: ast.Call) -> bool:
    """``importlib.import_module(f"{__name__}.{…}")``: the registry pattern."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if name != "import_module" or not call.args or not isinstance(call.args[0], ast.JoinedStr):
        return False
    first = call.args[0].values[0] if call.args[0].values else None
    return isinstance(first, ast.FormattedValue) and getattr(first.value, "id", "") == "__name__"


def cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of the import graph that are cycles (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in mods:
        if root in index:
            continue
        work = [(root, iter(sorted(mods[root].imports)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(mods[w].imports))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def cycle_edges(mods: dict[str, Module], comp: list[str]) -> list[str]:
    """The edges inside one cycle, ``a -> b`` with ``(lazy)`` for function-level imports."""
    inside = set(comp)
    return [f"{a} -> {b}" + (" (lazy)" if mods[a].imports[b] == "lazy" else "")
            for a in comp for b in sorted(mods[a].imports) if b in inside]


def build(root: Path = ROOT) -> dict[str, Module]:
    """The package's modules with their imports read."""
    mods = discover(root)
    for mod in mods.values():
        read_imports(mod, mods)
    return mods


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--edges", action="store_true", help="print every module's kvlab imports")
    ap.add_argument("--top", type=int, default=15, help="largest modules to list (lines)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the folder holding kvlab/ (default: this checkout)")
    args = ap.parse_args(argv)
    mods = build(args.root)
    total = sum(m.lines for m in mods.values())
    print(f"{len(mods)} modules, {total} lines, {sum(len(m.imports) for m in mods.values())} internal imports")
    print("\nlargest modules (lines):")
    for m in sorted(mods.values(), key=lambda m: -m.lines)[: args.top]:
        print(f"  {m.lines:5d}  {m.name}")
    if args.edges:
        print("\nimports (lazy = inside a function; type-only under TYPE_CHECKING):")
        for m in mods.values():
            if m.imports or m.type_only:
                tags = [t + (" (lazy)" if k == "lazy" else "") for t, k in sorted(m.imports.items())]
                tags += [f"{t} (type-only)" for t in sorted(m.type_only)]
                print(f"  {m.name}: {', '.join(tags)}")
    found = cycles(mods)
    print(f"\ncycles: {len(found)}")
    for comp in found:
        print(f"  [{', '.join(comp)}]")
        for edge in cycle_edges(mods, comp):
            print(f"      {edge}")
    largest = max(mods.values(), key=lambda m: m.lines)
    print(f"\nlargest module: {largest.name} ({largest.lines} lines)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
