"""The package's import graph has no circle, and every import points down the rooms (issue 46).

Every ``import`` and ``from ... import`` of a ``rollflow`` module counts, wherever it stands:
at the top, inside a function (a deferred import that only dodges a circle still makes
one), or under ``if TYPE_CHECKING:`` (two modules that need each other's types belong
together or apart, not in a loop). The graph is read from the source with ``ast``, so the
test imports nothing and sees the modules a test run would never load.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDERS = ("envs", "tasks", "generators", "config", "flows", "cluster", "ops", "storage", "policy")


def package_modules() -> dict[str, Path]:
    """``rollflow.<folder>.<module>`` -> its file, for every module the package installs."""
    modules = {"rollflow": REPO / "rollflow" / "__init__.py"}
    for folder in FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(("rollflow", *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (a package's ``__init__`` for its name)."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from pkg import module` names a module; `from module import name` does not
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]  # fmt: skip
            for target in targets:
                found = known(target) if target.startswith("rollflow") else None
                if found is not None and found != name:
                    graph[name].add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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


def test_the_finder_sees_a_circle_closed_by_a_deferred_or_type_only_import(tmp_path: Path) -> None:
    """The checker itself: a loop closed by an import inside a function, or under
    TYPE_CHECKING, is found; a plain chain is not a loop."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    (tmp_path / "one.py").write_text("from rollflow.tasks.two import thing\n")
    (tmp_path / "two.py").write_text("def thing():\n    from rollflow.tasks import one\n")
    (tmp_path / "three.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import rollflow.tasks.one\n"
    )
    modules = {f"rollflow.tasks.{n}": tmp_path / f"{n}.py" for n in ("one", "two", "three")}
    graph = import_graph(modules)
    assert graph == {"rollflow.tasks.one": {"rollflow.tasks.two"}, "rollflow.tasks.two": {"rollflow.tasks.one"},
                     "rollflow.tasks.three": {"rollflow.tasks.one"}}  # fmt: skip
    assert circles(graph) == [["rollflow.tasks.one", "rollflow.tasks.two"]]


def test_no_module_of_the_package_is_in_an_import_circle() -> None:
    modules = package_modules()
    assert len(modules) > 100, "the package's modules were not found"
    graph = import_graph(modules)
    assert "rollflow.generators.checkpoints" in graph["rollflow.tasks.train"], "the graph misses plain imports"
    found = circles(graph)
    assert not found, "import circles (each a list of modules that reach each other):\n" + "\n".join(
        ", ".join(m.removeprefix("rollflow.") for m in circle) for circle in found
    )


# The rooms, top to bottom: a module imports its own room or a room below it, never one
# above and never one beside it. ``rollflow`` itself (the public face: environment names,
# lazy flow entry points) is outside the order. ``cluster`` and ``ops`` share a rank: both
# serve the flows and use the stages' rooms, and neither imports the other.
ROOMS = (("flows",), ("cluster", "ops"), ("tasks",), ("generators",), ("config",), ("policy", "storage"), ("envs",))
# Known to point up, each a move still to make, not a rule (none today).
KNOWN_UPWARD: set[str] = set()


def room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) >= 3 else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for each import into a room above (or beside) the importer's."""
    rank = {name: index for index, rooms in enumerate(ROOMS) for name in rooms}
    found = []
    for name, targets in graph.items():
        for target in targets:
            low, high = room(name), room(target)
            if low is None or high is None or low == high:
                continue
            if rank[high] <= rank[low]:
                found.append(f"{name.removeprefix('rollflow.')} -> {target.removeprefix('rollflow.')}")
    return sorted(found)


def test_the_room_checker_sees_an_import_up_or_across() -> None:
    graph = {"rollflow.tasks.a": {"rollflow.flows.b", "rollflow.policy.c", "rollflow.config.run"},
             "rollflow.policy.c": {"rollflow.storage.d", "rollflow.envs.e"},
             "rollflow.generators.f": {"rollflow.config.run", "rollflow.tasks.g"}}  # fmt: skip
    assert upward_imports(graph) == ["generators.f -> tasks.g", "policy.c -> storage.d", "tasks.a -> flows.b"]


def test_every_import_points_down_the_rooms() -> None:
    folders = {name for rooms in ROOMS for name in rooms}
    assert folders == set(FOLDERS), "a folder without a room, or a room without its folder"
    found = upward_imports(import_graph(package_modules()))
    assert KNOWN_UPWARD <= set(found), f"no longer pointing up, take out of KNOWN_UPWARD: {KNOWN_UPWARD - set(found)}"
    upward = [edge for edge in found if edge not in KNOWN_UPWARD]
    assert not upward, "imports that point up (or across) the rooms " + " > ".join(
        "/".join(rooms) for rooms in ROOMS
    ) + ":\n" + "\n".join(upward)
