"""The package's layout rules, read from the source with ast: no import cycle inside testbed/, and the
engine (testbed/engine/) stays sans-I/O, importing only pure standard-library modules and numpy.

Every import statement counts, also those inside functions and `if TYPE_CHECKING:` blocks: a lazy
import still ties two modules together.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "testbed"

# What testbed/engine/ may import besides itself: no clock (time), no sleep, no sockets (socket, zmq,
# asyncio), no processes, no files, no torch or simpy. Extend only with modules that do no I/O.
ENGINE_ALLOWED = {"__future__", "abc", "bisect", "collections", "dataclasses", "enum", "functools", "heapq",
                  "itertools", "json", "math", "numpy", "operator", "typing"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, name: str, known: set[str]) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file: a testbed module where one is named (the deepest
    that exists: `from testbed.sim import run` is testbed.sim.run), else the top-level name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t not in known and "." in t and t.startswith("testbed."):
                t = t.rpartition(".")[0]
            out.append((t if t in known else t.split(".")[0], node.lineno))
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: {t for t, _ in imports(p, m, known) if t in known and t != m} for m, p in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative DFS with colours)."""
    colour = dict.fromkeys(graph, 0)  # 0 unvisited, 1 on the stack, 2 done
    for root in sorted(graph):
        if colour[root]:
            continue
        stack = [(root, iter(sorted(graph[root])))]
        path = [root]
        colour[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour[child] == 1:
                return path[path.index(child):] + [child]
            elif colour[child] == 0:
                colour[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph[child]))))
    return None


def test_the_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "testbed.sim.run" in graph["testbed.cli"]             # inside cmd_simulate
    assert "testbed.bench.serve" in graph["testbed.cli"]         # inside build_parser
    assert "testbed.engine.request" in graph["testbed.engine.core"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle) + " (move what both need into a module below both)"


def test_engine_imports_no_io_module():
    mods = modules()
    bad = []
    for name, path in mods.items():
        if not name.startswith("testbed.engine"):
            continue
        for target, line in imports(path, name, set(mods)):
            if not target.startswith("testbed.engine") and target not in ENGINE_ALLOWED:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: imports {target}")
    assert not bad, "testbed/engine/ must stay sans-I/O:\n" + "\n".join(bad)


# Packages a package must never import, so the arrows between them point one way: engine <- specs <- runs, text <-
# workload <- worker <- profiling <- sim <- runtime <- server, entrypoints <- cli. (The HTTP layer talks to the engine processes only through runtime/.)
MODE_NEUTRAL_FORBIDS = ("testbed.sim", "testbed.runtime", "testbed.server", "testbed.worker", "testbed.dashboard",
                        "testbed.cli", "testbed.bench", "testbed.profiling")
FORBIDDEN = {
    "testbed.engine": ("testbed.runtime", "testbed.server", "testbed.worker", "testbed.sim", "testbed.dashboard",
                       "testbed.cli", "testbed.workload", "testbed.specs", "testbed.profiling"),
    "testbed.workload": MODE_NEUTRAL_FORBIDS,  # traces and specs serve both modes: they import neither
    "testbed.specs": MODE_NEUTRAL_FORBIDS + ("testbed.workload", "testbed.runs"),
    "testbed.runtime": ("testbed.server", "testbed.dashboard", "testbed.cli", "testbed.bench", "testbed.entrypoints"),
    # the two entrypoints, the HTTP server and the offline LLM/replay, share what is below them, not each other
    "testbed.entrypoints": ("testbed.server", "testbed.dashboard", "testbed.cli", "testbed.bench"),
    # text processing of both front-ends: on the engine's parameters alone
    "testbed.text": ("testbed.sim", "testbed.profiling", "testbed.worker", "testbed.runtime", "testbed.server",
                     "testbed.entrypoints", "testbed.dashboard", "testbed.cli", "testbed.bench", "testbed.runs"),
    "testbed.worker": ("testbed.runtime", "testbed.server", "testbed.dashboard", "testbed.cli", "testbed.sim",
                       "testbed.profiling"),
    # profiles are measured on the worker and read by the simulator: worker <- profiling <- sim
    "testbed.profiling": ("testbed.sim", "testbed.runtime", "testbed.server", "testbed.dashboard", "testbed.cli",
                          "testbed.bench"),
    "testbed.sim": ("testbed.runtime", "testbed.server", "testbed.dashboard", "testbed.cli", "testbed.bench"),
    "testbed.server": ("testbed.dashboard", "testbed.cli", "testbed.entrypoints", "zmq"),
    # run records sit on the engine alone: both modes write them, the dashboard and the CLI read them
    "testbed.runs": ("testbed.sim", "testbed.profiling", "testbed.worker", "testbed.runtime", "testbed.server",
                     "testbed.dashboard", "testbed.cli", "testbed.bench", "testbed.workload"),
    # run figures <- compare's table (its --png draws them) <- the dashboard (which shows both)
    "testbed.runs.series": ("testbed.runs.compare",),
    "testbed.runs.plots": ("testbed.runs.compare",),
}


def _under(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def test_packages_import_one_way_and_http_has_no_zmq():
    mods = modules()
    bad = []
    for name, path in mods.items():
        for package, forbidden in FORBIDDEN.items():
            if not _under(name, package):
                continue
            for target, line in imports(path, name, set(mods)):
                if any(_under(target, f) for f in forbidden):
                    bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {package} imports {target}")
    assert not bad, "imports against the package direction:\n" + "\n".join(bad)


def test_the_direction_check_sees_a_violation():
    """The check itself can fail: the HTTP layer's modules do import the runtime (allowed), and a runtime
    module importing the server would be caught by the same walk."""
    mods = modules()
    graph = import_graph()
    assert any(_under(t, "testbed.runtime") for t in graph["testbed.server.state"])
    assert any(_under(t, f) for t in graph["testbed.server.state"] for f in FORBIDDEN["testbed.runtime"])
    assert "zmq" in {t for t, _ in imports(mods["testbed.runtime.client"], "testbed.runtime.client", set(mods))}


def _closure(graph: dict[str, set[str]], root: str) -> set[str]:
    """Every testbed module `root` imports, directly or through others (root included)."""
    seen, todo = {root}, [root]
    while todo:
        for t in graph[todo.pop()] - seen:
            seen.add(t)
            todo.append(t)
    return seen


def test_the_api_boundary_checks_grammars_without_torch():
    """The front-ends (API server, offline LLM) refuse a bad schema/regex/grammar through grammar_compile, whose
    testbed imports reach no torch (the worker's grammar.py, with the torch bitmask, is not among them)."""
    mods, graph = modules(), import_graph()
    reach = _closure(graph, "testbed.worker.grammar_compile")
    assert "testbed.worker.grammar" not in reach
    bad = [f"{m}:{line}" for m in reach for t, line in imports(mods[m], m, set(mods)) if t == "torch"]
    assert not bad, "the grammar check imports torch: " + ", ".join(bad)
    for front in ("testbed.server.params", "testbed.entrypoints.llm"):
        assert "testbed.worker.grammar_compile" in graph[front] and "testbed.worker.grammar" not in graph[front]


def test_the_package_top_level_is_a_table_of_contents():
    """testbed/ holds packages named for what they are; besides cli.py and __init__.py at most six modules sit at
    its top (the offline API's output classes, the CLI's shared flags, the notebooks' helpers)."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("cli.py", "__init__.py"))
    assert len(loose) <= 6, f"{len(loose)} top-level modules in testbed/ ({', '.join(loose)}): place them in a package"


def test_nothing_points_outside_the_clone():
    """A clone is all a user has: no README, doc, notebook, script or module refers to the `shared` folder
    beside the repository, where the project's working notes live (no clone has it)."""
    repo, needle = PACKAGE.parent, "../" + "shared"
    skip = {".git", ".venv", "runs", "test-artifacts", "node_modules"}
    texts = [p for p in repo.rglob("*") if p.is_file() and not skip & set(p.relative_to(repo).parts)
             and p.suffix in {".md", ".py", ".toml", ".sh", ".cfg", ".txt", ".ipynb", ""}]
    assert any(p.name == "README.md" for p in texts) and any(p.parent.name == "experiments" for p in texts)
    outside = [str(p.relative_to(repo)) for p in texts if needle in p.read_text(errors="replace")]
    assert not outside, outside
