"""The floors of docs/architecture.md hold: no module imports one on a floor above its own, and no imports go
round in a circle (TYPE_CHECKING and function-level imports count). The table in the doc is the rule."""

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def floors() -> list[list[str]]:
    """The modules of each floor, top first, as docs/architecture.md's table lists them."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (.+?) \| .+ \|$", text, re.M)
    assert [int(number) for number, _ in rows] == list(range(1, len(rows) + 1)), "floors numbered 1, 2, …"
    return [re.findall(r"`([\w.]+)`", modules) for _, modules in rows]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Each module of reame/ and the modules of reame/ it imports."""
    modules = {module_name(path): path for path in (ROOT / "reame").rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "reame":
                for alias in node.names:  # `from reame.arca import state` imports the module reame.arca.state
                    target = f"{node.module}.{alias.name}"
                    graph[name].add(target if target in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(alias.name for alias in node.names if alias.name.split(".")[0] == "reame")
    return {name: {target for target in graph[name] if target in modules} for name in modules}


def floor_of(module: str, table: list[list[str]]) -> int:
    matches = [(len(prefix), number) for number, group in enumerate(table) for prefix in group
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is on no floor of docs/architecture.md"
    return max(matches)[1]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
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


def test_no_module_imports_from_a_floor_above_its_own():
    table = floors()
    graph = imports()
    upward = sorted(f"{module} (floor {floor_of(module, table) + 1}) imports {target} "
                    f"(floor {floor_of(target, table) + 1})"
                    for module, targets in graph.items() for target in targets
                    if floor_of(target, table) < floor_of(module, table))
    assert upward == []


def test_no_imports_go_round_in_a_circle():
    assert circles(imports()) == []


def test_the_checks_would_see_a_circle_and_an_upward_import():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    table = floors()
    assert floor_of("reame.model.backend", table) > floor_of("reame.engine.scheduler", table)


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


TRANSPORT = "reame.server.http"
# What may import the transport: the router that hands it requests and the listener that makes its handlers.
TRANSPORT_USERS = {"reame.server.app", "reame.server.listener"}


def encoders_and_below(graph: dict[str, set[str]]) -> set[str]:
    """The API families' encoders (reame.server.apis, generation, turn) and everything they stand on."""
    encoders = {name for name in graph if name.startswith("reame.server.apis.")} | \
        {"reame.server.generation", "reame.server.turn"}
    return encoders.union(*(reached(graph, name) for name in encoders))


def test_the_api_encoders_and_what_they_stand_on_know_no_http():
    """Inside reame/server the API families encode the exchange's items as frames sent to a client
    (client.py: gone, send), never through the HTTP transport, so each is tested without sockets
    (tests/fakes/client.py); only the router and the listener import it."""
    graph = imports()
    assert "reame.server.exchange" in encoders_and_below(graph)
    assert TRANSPORT not in encoders_and_below(graph)
    assert {name for name in graph if TRANSPORT in graph[name]} <= TRANSPORT_USERS


def test_the_transport_check_sees_an_encoder_that_imports_http():
    graph = {name: set(targets) for name, targets in imports().items()}
    graph["reame.server.validation"].add(TRANSPORT)  # an encoder's helper reaching for the transport
    assert TRANSPORT in encoders_and_below(graph)


def test_every_module_is_named_in_the_architecture_doc():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"^\| `([\w/]+\.py)` \|", text[text.index("## Every module"):], re.M))
    modules = {str(path.relative_to(ROOT / "reame")) for path in (ROOT / "reame").rglob("*.py")
               if path.name != "__init__.py"}
    assert sorted(modules - named) == [] and sorted(named - modules) == []
