"""The import graph of the ``kvlab`` package: module sizes, kvlab-internal imports, cycles, the floor rule.

Usage: ``python benchmarks/import_graph.py [--packages] [--edges] [--top N] [--root DIR]``. Reads the source only
(nothing is imported). An edge ``a -> b`` means module ``a`` imports ``b`` at run time, at module level or inside a
function (a lazy import is still an import: a cycle it closes is a cycle). ``from pkg import name``
points at ``pkg.name`` when that is a module, else at ``pkg``. Imports under ``if TYPE_CHECKING:`` are not
run and are listed apart. A package ``__init__`` that imports every submodule with
``importlib.import_module(f"{__name__}.…")`` (the policy registry) gets an edge to each of them.
Importing ``a.b`` also runs ``a/__init__``; that implicit edge is left out (a package importing its own
submodules is not a cycle). Cycles are the strongly connected components of more than one module (Tarjan).

Package level (the plan of the house, README "Layout"): every module belongs to a package (``kvlab.x`` for
``kvlab/x/…`` and for the top-level module ``kvlab/x.py``; ``kvlab`` for ``kvlab/__init__.py``), and every
package sits on a floor (:data:`FLOORS`, bottom first). A package imports only packages on its own floor or
below, lazily or not (imports under ``if TYPE_CHECKING:`` excepted), and no packages import each other in a
circle. Every import that goes up a floor is printed as ``file:line``, with every package cycle and every
package that has no floor. Exit status 1 when there is a module cycle, an up-edge, a package cycle or a
package without a floor.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "kvlab"

#: The floors of the house, bottom first: a package may import only packages on its own floor or below.
#: Names are packages (``kvlab/x/``) or top-level modules (``kvlab/x.py``); a ``*`` matches like a file glob.
#: Where the real imports put a package: kvlab.policies sits above kvlab.cache (policies build on the cache's
#: block, context and compiled-policy types; the cache sees a policy only as the object it is given, the
#: registry lookup happens above it); the data (traces, profiles, result files) sits below the tiers, which
#: probe with a small workload, and below every driver, which writes its results through kvlab.results;
#: kvlab.plots draws what the analysis computes, below the runner and the studies that draw with it.
FLOORS: dict[str, tuple[str, ...]] = {
    "base": ("kvlab.errors", "kvlab.names", "kvlab.units", "kvlab.inputs", "kvlab.arguments", "kvlab.metrics",
             "kvlab.schema", "kvlab.data"),
    "keys": ("kvlab.hashing",),
    "core": ("kvlab.cache",),
    "policies": ("kvlab.policies",),
    "data": ("kvlab.workload", "kvlab.profiles", "kvlab.results", "kvlab.stats"),
    "tiers": ("kvlab.tiers",),
    "drivers": ("kvlab.replay", "kvlab.sim", "kvlab.engine"),
    "analysis": ("kvlab.analysis", "kvlab.plots"),
    "runner": ("kvlab.experiment", "kvlab.sweep", "kvlab.published"),
    "studies": ("kvlab.studies", "kvlab.layout"),
    "top": ("kvlab.figures", "kvlab.figures_index", "kvlab.demo", "kvlab.cli*", "kvlab.needs", "kvlab.__main__",
            "kvlab"),
}


@dataclass
class Module:
    """One module of the package: its dotted name, file, line count and the imports found in it."""

    name: str
    path: Path
    lines: int
    is_package: bool
    imports: dict[str, str] = field(default_factory=dict)  # target -> "top" | "lazy" (top wins)
    type_only: set[str] = field(default_factory=set)
    lines_of: dict[str, list[int]] = field(default_factory=dict)  # target -> line of each run-time import


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

    def add(target: str, lazy: bool, type_only: bool, line: int) -> None:
        while target and target not in mods:  # ``import kvlab.x.y.z`` of a name: its nearest module
            target = target.rpartition(".")[0]
        if not target.startswith(PACKAGE) or target == mod.name:
            return
        if type_only:
            mod.type_only.add(target)
            return
        mod.lines_of.setdefault(target, []).append(line)
        if mod.imports.get(target) != "top":
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
                add(alias.name, lazy, type_only, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in mods else base, lazy, type_only, node.lineno)
        elif isinstance(node, ast.Call) and mod.is_package and _imports_every_submodule(node):
            for other in mods:
                if other.rpartition(".")[0] == mod.name:
                    add(other, lazy, type_only, node.lineno)
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


def cycles(mods: Mapping[str, Module]) -> list[list[str]]:
    """Strongly connected components of the module import graph that are cycles, sorted."""
    return components({name: m.imports for name, m in mods.items()})


def components(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node of ``graph`` (node -> the nodes it points at;
    every target is a node) (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
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
                    work.append((w, iter(sorted(graph[w]))))
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


def package_of(module: str) -> str:
    """The package a module belongs to: ``kvlab.x`` for ``kvlab.x`` and everything under it; ``kvlab`` itself."""
    return ".".join(module.split(".")[:2])


def floor_of(package: str, floors: Mapping[str, tuple[str, ...]] = FLOORS) -> int | None:
    """The position (0 = bottom) of the floor ``package`` sits on, None when no floor names it."""
    for number, names in enumerate(floors.values()):
        if any(fnmatch.fnmatchcase(package, name) for name in names):
            return number
    return None


@dataclass(frozen=True)
class Edge:
    """One run-time import of a module in ``source`` (a package) of a module in ``target`` (a package)."""

    file: str  # relative to the root, e.g. kvlab/cache/prefix_cache.py
    line: int
    module: str
    imported: str
    lazy: bool

    @property
    def source(self) -> str:
        return package_of(self.module)

    @property
    def target(self) -> str:
        return package_of(self.imported)

    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class PackageReport:
    """The package-level check: imports going up a floor, package cycles (with the edges inside each),
    packages no floor names. ``ok`` when all three are empty."""

    up_edges: list[Edge]
    cycles: list[list[str]]
    cycle_edges: dict[tuple[str, ...], list[Edge]]
    unplaced: list[str]
    lines: dict[str, int]  # package -> lines of its modules
    modules: dict[str, int]  # package -> number of modules

    @property
    def ok(self) -> bool:
        return not (self.up_edges or self.cycles or self.unplaced)

    def files(self) -> set[str]:
        """The files holding an up-edge or an import inside a package cycle."""
        return {e.file for e in self.up_edges} | {e.file for es in self.cycle_edges.values() for e in es}


def edges(mods: Mapping[str, Module], root: Path = ROOT) -> list[Edge]:
    """Every run-time import between two different packages: one per import statement and imported package
    (the first module it names), in file order."""
    out: dict[tuple[str, int, str], Edge] = {}
    for m in mods.values():
        file = m.path.relative_to(root).as_posix()
        for target, kind in sorted(m.imports.items()):
            if package_of(target) == package_of(m.name):
                continue
            for line in m.lines_of.get(target, []):
                out.setdefault((file, line, package_of(target)), Edge(file, line, m.name, target, kind == "lazy"))
    return sorted(out.values(), key=lambda e: (e.file, e.line, e.imported))


def check_packages(mods: Mapping[str, Module], root: Path = ROOT, *, ignore: Iterable[str] = (),
                   floors: Mapping[str, tuple[str, ...]] = FLOORS) -> PackageReport:
    """The floor rule and package cycles over ``mods``; imports in the files of ``ignore`` (paths relative to
    ``root``) are left out (the known violations a test allows while they are being moved)."""
    skip = set(ignore)
    found = [e for e in edges(mods, root) if e.file not in skip]
    packages = sorted({package_of(name) for name in mods})
    floor = {p: floor_of(p, floors) for p in packages}
    up = [e for e in found if floor[e.source] is not None and floor[e.target] is not None
          and floor[e.target] > floor[e.source]]
    graph: dict[str, set[str]] = {p: set() for p in packages}
    for e in found:
        graph[e.source].add(e.target)
    comps = components(graph)
    inside = {tuple(c): [e for e in found if e.source in c and e.target in c] for c in comps}
    lines: dict[str, int] = {p: 0 for p in packages}
    count: dict[str, int] = {p: 0 for p in packages}
    for name, m in mods.items():
        lines[package_of(name)] += m.lines
        count[package_of(name)] += 1
    return PackageReport(up, comps, inside, [p for p in packages if floor[p] is None], lines, count)


def print_packages(report: PackageReport, detail: bool, floors: Mapping[str, tuple[str, ...]] = FLOORS) -> None:
    """The package-level report; ``detail`` adds each floor's packages with their sizes."""
    names = list(floors)
    if detail:
        print("\nfloors (bottom first; a package imports only its own floor or below):")
        for p in sorted(report.lines, key=lambda p: (floor_of(p, floors) is None, floor_of(p, floors) or 0, p)):
            number = floor_of(p, floors)
            label = f"{number} {names[number]}" if number is not None else "- (none)"
            print(f"  {label:<12} {p:<24} {report.modules[p]:4d} modules {report.lines[p]:6d} lines")
    print(f"\npackage imports going up a floor: {len(report.up_edges)}")
    for e in report.up_edges:
        src, dst = floor_of(e.source, floors), floor_of(e.target, floors)
        print(f"  {e.where()}: {e.source} ({names[src]}) -> {e.target} ({names[dst]})"  # type: ignore[index]
              + (" (lazy)" if e.lazy else ""))
    print(f"package cycles: {len(report.cycles)}")
    for comp in report.cycles:
        print(f"  [{', '.join(comp)}]")
        pairs: dict[tuple[str, str], list[str]] = {}
        down = 0
        for e in report.cycle_edges[tuple(comp)]:
            src, dst = floor_of(e.source, floors), floor_of(e.target, floors)
            if src is not None and dst is not None and dst < src:
                down += 1
                continue
            pairs.setdefault((e.source, e.target), []).append(e.where() + (" (lazy)" if e.lazy else ""))
        print(f"      closed by ({down} imports down a floor inside it not listed):")
        for (a, b), where in sorted(pairs.items()):
            print(f"      {a} -> {b}: {', '.join(where)}")
    if report.unplaced:
        print(f"packages on no floor (add them to FLOORS): {', '.join(report.unplaced)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packages", action="store_true", help="also list every package with its floor and size")
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
    report = check_packages(mods, args.root)
    print_packages(report, args.packages)
    return 1 if found or not report.ok else 0


if __name__ == "__main__":
    sys.exit(main())
