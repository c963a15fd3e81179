#!/usr/bin/env python3
"""Check the code's own imports: no import runs up a layer, no two modules import each other in a loop.

Reads every module of the packages below with ``ast`` (nothing is imported or run), takes every
import it makes (module level, inside functions, under ``TYPE_CHECKING``: each is a dependency a
reader has to follow), and fails on

    1. an import of a module in a layer above the importer's (the table ``LAYERS``),
    2. an import cycle: a strongly connected set of two or more modules, and
    3. a package cycle: the same, with every module taken as its package at depth 2 and at
       depth 3 (``disagg.engine``, ``disagg.flow``; ``disagg.engine.vllm``, ``disagg.tools.sim``):
       two packages whose modules import each other, even without a module cycle.

The layers, lowest first (an import may point down or sideways within a layer, never up)::

    0 transfer    kv_transfer                     state transfer, usable without Ray or HTTP
    1 core        disagg (all but what follows)   api, engine, router, reuse, flow, workers, config, ...
    2 tools       disagg.tools                    offline tools over the core: bench, sim, plan
    2 serving     deployments                     the Ray Serve application
    3 launchers   disagg.launch, disagg.__main__  what starts the system or a tool

Tools and serving are peers: neither imports the other.

Usage: ``python tools/check_imports.py [ROOT]`` (exit 1 and one line per violation when any).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("kv_transfer", "disagg", "deployments")  # the code whose imports are checked
# (module prefix, layer name, rank): the longest matching prefix classifies a module
LAYERS: tuple[tuple[str, str, int], ...] = (
    ("kv_transfer", "transfer", 0),
    ("disagg", "core", 1),
    ("disagg.tools", "tools", 2),
    ("deployments", "serving", 2),
    ("disagg.launch", "launchers", 3),
    ("disagg.__main__", "launchers", 3),
)


@dataclass(frozen=True, slots=True)
class Import:
    importer: str  # dotted module name
    target: str  # the imported module (dotted)
    line: int  # line number in the importer


def layer_of(module: str) -> tuple[str, int]:
    """(layer name, rank) of a module: its longest matching prefix in ``LAYERS``."""
    best = None
    for prefix, name, rank in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, name, rank)
    assert best is not None, f"{module} is in no layer"
    return best[1], best[2]


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``PACKAGES`` under ``root``."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> Iterator[Import]:
    """The imports of module ``name`` that name a module in ``known``."""
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known_prefix(alias.name, known)
                if target:
                    yield Import(name, target, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importer's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            for alias in node.names:  # ``from a import b`` imports module a.b when there is one
                target = _known_prefix(f"{base}.{alias.name}", known) if base else None
                if target != f"{base}.{alias.name}":
                    target = _known_prefix(base, known)
                if target:
                    yield Import(name, target, node.lineno)


def _known_prefix(dotted: str, known: set[str]) -> str | None:
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return None


def upward(edges: list[Import]) -> list[Import]:
    """Imports of a module in a higher layer, or between the two peer layers of rank 2."""
    bad = []
    for e in edges:
        (src, src_rank), (dst, dst_rank) = layer_of(e.importer), layer_of(e.target)
        if dst_rank > src_rank or (dst_rank == src_rank and src != dst):
            bad.append(e)
    return bad


def cycles(edges: list[Import]) -> list[list[str]]:
    """Strongly connected sets of two or more modules (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.importer != e.target:
            graph.setdefault(e.importer, set()).add(e.target)
            graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # iterative enough for this code base: recursion depth = import depth
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def check(root: Path) -> list[str]:
    """One line per violation (empty: the layering holds and there is no cycle)."""
    mods = modules(root)
    known = set(mods)
    edges = [e for name, path in mods.items() for e in imports(name, path, known)]
    lines = []
    for e in upward(edges):
        lines.append(f"upward import: {mods[e.importer].relative_to(root)}:{e.line} {e.importer} "
                     f"({layer_of(e.importer)[0]}) -> {e.target} ({layer_of(e.target)[0]})")
    module_cycles = cycles(edges)
    for comp in module_cycles:
        lines.append("import cycle: " + " <-> ".join(comp))
    for depth in PACKAGE_DEPTHS:
        for comp in cycles([Import(_package(e.importer, depth), _package(e.target, depth), e.line) for e in edges]):
            if comp not in module_cycles:  # modules no deeper than ``depth`` are their own package
                lines.append(f"package cycle (depth {depth}): " + " <-> ".join(comp))
    return lines


PACKAGE_DEPTHS = (2, 3)


def _package(module: str, depth: int) -> str:
    return ".".join(module.split(".")[:depth])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    problems = check(root)
    for line in problems:
        print(line)
    print(f"{len(problems)} import problem(s) in {', '.join(PACKAGES)}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
