"""The house rules a newcomer can read: the layers hold (import-linter's contracts in pyproject.toml), no module
imports itself back through others (TYPE_CHECKING imports included), and no module grows past 500 lines.

The allow-lists only shrink: a module listed in OVER_LIMIT may not grow past its figure, and once it is back under
the limit its entry must go (the test says so), as import-linter says of an ignored import that no longer exists."""

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from support.harness import REPO

LIMIT = 500
FOLDERS = ("cluster", "workers", "router", "cli")

# Modules still over the limit, with the most lines each may have until it is split (the compiled .c files aside).
OVER_LIMIT = {
}


def _modules() -> dict[str, int]:
    return {str(path.relative_to(REPO)): len(path.read_text().splitlines())
            for folder in FOLDERS for path in sorted((REPO / folder).rglob("*.py"))}


def test_no_module_over_the_limit():
    sizes = _modules()
    over = {path: lines for path, lines in sizes.items() if lines > OVER_LIMIT.get(path, LIMIT)}
    assert not over, f"modules over {LIMIT} lines (or past their allow-list figure): split them: {over}"


def test_the_allow_list_only_shrinks():
    sizes = _modules()
    stale = sorted(path for path in OVER_LIMIT if sizes.get(path, 0) <= LIMIT)
    assert not stale, f"back under {LIMIT} lines or gone: remove from OVER_LIMIT: {stale}"


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.find_modules_directly_imported_by(nxt)))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_module_imports_itself_back():
    graph = grimp.build_graph("shardbroker", cache_dir=None)
    assert not _cycles(graph)


def test_the_cycle_finder_finds_one():
    graph = grimp.ImportGraph()
    for name in ("a", "a.b", "a.c", "a.d"):
        graph.add_module(name)
    graph.add_import(importer="a.b", imported="a.c")
    graph.add_import(importer="a.c", imported="a.b")
    graph.add_import(importer="a.c", imported="a.d")
    assert _cycles(graph) == [["a.b", "a.c"]]


def test_import_contracts_hold():
    """The layers, and no cycles between the rooms of a folder, as pyproject.toml states them."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.fail("lint-imports (import-linter) is not installed: pip install -e '.[test]'")
    done = subprocess.run([lint, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
