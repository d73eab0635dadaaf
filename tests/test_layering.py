"""Layers import downward only: what validates a peer's record or carries rollouts loads no model library."""

import ast
import os
import re
import subprocess
import sys
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def imported_after(modules: list[str]) -> set[str]:
    code = f"import sys; import {', '.join(modules)}; print(' '.join(sorted(sys.modules)))"
    return set(
        subprocess.run(
            [sys.executable, "-c", code], check=True, cwd=REPO, capture_output=True, text=True
        ).stdout.split()
    )


def test_the_record_validator_transports_and_stats_load_no_model_library():
    loaded = imported_after(
        ["node.transport.records", "node.transport.base", "node.stats", "node.metrics", "node.files"]
    )
    assert not loaded & {"transformers", "node.model", "node.state", "node.trainer"}


def test_rollout_data_types_are_torch_free():
    loaded = imported_after(["node.rollouts.base", "node.files"])
    assert "torch" not in loaded and "node.trainer" not in loaded


def test_choosing_own_and_peers_rollouts_is_torch_free():
    """Which rollouts a node trains on is decided without a model library (grading sits with the tasks)."""
    loaded = imported_after(["node.sharing", "node.local_rollouts", "node.compute"])
    assert "torch" not in loaded and "node.trainer" not in loaded


# The layers, lowest first (docs/ARCHITECTURE.md explains each). A module may import from the layers below it,
# never from one above (within its own, see WITHIN_LAYER). A module missing here fails the test: place it.
# Each name is a room: a module, or a package with everything under it that no room of a longer name claims.
LAYERS = [
    ("wire", ["protocol"]),
    ("foundations", ["node", "node.config", "node.files", "node.aio", "node.display", "node.host_memory"]),
    (
        "data",
        [
            "node.rollouts.base",
            "node.tasks",
            "node.stats",
            "node.metrics",
            "node.weights",
            "node.compute",
            "node.device",
        ],
    ),
    (
        "network and policy",
        [
            "node.transport",
            "node.model",
            "node.pretrained",
            "node.warmstart",
            "node.state",
            "node.trainer",
            "node.rollouts",
        ],
    ),
    (
        "components",
        [
            "node.policy",
            "node.local_rollouts",
            "node.sharing",
            "node.evaluation",
            "node.telemetry",
            "node.averaging",
            "node.pipeline",
        ],
    ),
    ("node", ["node.loop", "node.dashboard"]),
    ("commands", ["node.cli", "node.commands", "node.runtime", "node.pipeline.commands", "node.dashboard.commands"]),
]

# Inside one layer a room imports its own modules freely, and another room of its layer only along these edges; a
# room not named here imports nothing else of its layer. docs/ARCHITECTURE.md ("Inside a layer") states the same
# table, and says why each edge is there.
WITHIN_LAYER = {
    "node.tasks": {"node.rollouts.base"},
    "node.weights": {"node.device"},
    "node.model": {"node.warmstart", "node.pretrained"},
    "node.state": {"node.model"},
    "node.rollouts": {"node.model"},
    "node.policy": {"node.pipeline"},
    "node.pipeline": {"node.averaging"},
    "node.loop": {"node.dashboard"},
    "node.cli": {"node.commands", "node.pipeline.commands", "node.dashboard.commands", "node.runtime"},
    "node.commands": {"node.runtime"},
    "node.pipeline.commands": {"node.runtime"},
    "node.dashboard.commands": {"node.runtime"},
}


def room_of(module: str) -> tuple[str, int] | None:
    """The room of `module` (its longest prefix in LAYERS) and the rank of that room's layer; None where LAYERS
    places it nowhere."""
    rooms = [
        (prefix, rank)
        for rank, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        # "node": its __init__ only, or every module would be placed
        if module == prefix or (module.startswith(prefix + ".") and prefix != "node")
    ]
    return max(rooms, key=lambda room: len(room[0]), default=None)


def layering_breaches(graph: dict[str, set[str]]) -> list[str]:
    """One line for each module of `graph` (module -> the project modules it imports) that LAYERS cannot place, each
    import upward, and each import into another room of the same layer that WITHIN_LAYER does not allow."""
    breaches = [
        f"{module} is in no layer of tests/test_layering.py: LAYERS"
        for module in sorted(graph.keys() | set().union(*graph.values()))
        if room_of(module) is None
    ]
    for module, imported_modules in sorted(graph.items()):
        if room_of(module) is None:
            continue
        room, rank = room_of(module)
        for imported in sorted(imported_modules):
            if room_of(imported) is None:
                continue
            other_room, other_rank = room_of(imported)
            allowed = WITHIN_LAYER.get(room, set())
            if other_rank > rank:
                breaches.append(f"{module} ({LAYERS[rank][0]}) imports {imported} ({LAYERS[other_rank][0]}): upward")
            elif other_rank == rank and other_room not in allowed | {room}:
                breaches.append(
                    f"{module} imports {imported}: inside the layer {LAYERS[rank][0]!r} the room {room} may import "
                    f"{', '.join(sorted(allowed)) or 'nothing but its own modules'} (WITHIN_LAYER)"
                )
    return breaches


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each group of modules in `graph` that reach each other through imports (Tarjan's strongly
    connected components), as a chain that ends where it starts; a module importing itself is no cycle."""
    index, lowlink, on_stack, stack, groups = {}, {}, set(), [], []

    def visit(module: str) -> None:
        index[module] = lowlink[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.get(module, ())):
            if imported not in index:
                visit(imported)
                lowlink[module] = min(lowlink[module], lowlink[imported])
            elif imported in on_stack:
                lowlink[module] = min(lowlink[module], index[imported])
        if lowlink[module] == index[module]:
            group = set()
            while module not in group:
                group.add(stack.pop())
            on_stack.difference_update(group)
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(shortest_cycle(graph, group) for group in groups)


def shortest_cycle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest chain of imports inside `group` from its first module back to it (breadth first)."""
    start = min(group)
    came_from, frontier = {start: None}, [start]
    while frontier:
        following = []
        for module in frontier:
            for imported in sorted(graph[module] & group):
                if imported == start:
                    chain = [module]
                    while came_from[chain[-1]] is not None:
                        chain.append(came_from[chain[-1]])
                    return chain[::-1] + [start]
                if imported not in came_from:
                    came_from[imported] = module
                    following.append(imported)
        frontier = following
    raise AssertionError(f"{sorted(group)} is no cycle")


def project_imports(source: str, module: str, is_package: bool, is_module: Callable[[str], bool]) -> set[str]:
    """Every node.* / protocol.* module that `source`, the text of `module`, imports, at the top or inside a function.
    `from PACKAGE import NAME` imports the module PACKAGE.NAME where `is_module` says there is one (`from node import
    loop` is an import of node.loop), else a name defined in PACKAGE."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for item in ast.walk(ast.parse(source)):
        if isinstance(item, ast.Import):
            found |= {alias.name for alias in item.names}
        elif isinstance(item, ast.ImportFrom):
            base = item.module or ""
            if item.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - item.level + 1] + ([base] if base else []))
            found |= {f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base for alias in item.names}
    return {name for name in found if name.split(".")[0] in ("node", "protocol")} - {module}


def is_module(name: str) -> bool:
    """Whether this repository has a module `name`: a .py file, or a folder (a package, with or without
    __init__.py)."""
    path = os.path.join(REPO, *name.split("."))
    return os.path.isfile(path + ".py") or os.path.isdir(path)


def project_graph() -> dict[str, set[str]]:
    """Each module of node/ and protocol/, with the project modules it imports."""
    graph = {}
    for top in ("node", "protocol"):
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            for name in (n for n in files if n.endswith(".py")):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, REPO)[: -len(".py")].replace(os.sep, ".").removesuffix(".__init__")
                with open(path) as file:
                    graph[module] = project_imports(file.read(), module, name == "__init__.py", is_module)
    return graph


def test_every_module_is_placed_and_imports_only_what_its_layer_and_room_allow():
    """Downward to any lower layer; inside its own layer, to its own room and the rooms WITHIN_LAYER names."""
    assert layering_breaches(project_graph()) == []


def test_no_modules_import_each_other_through_any_chain():
    """Not even inside functions: modules that need each other are one job split apart, or a module missing below
    them."""
    assert [" -> ".join(chain) for chain in import_cycles(project_graph())] == []


def test_from_a_package_import_a_module_is_an_import_of_that_module():
    modules = {"node.loop", "node.pipeline", "node.pipeline.server", "node.transport"}
    sharing = "from node import loop\nfrom . import loop as again\nfrom node.transport import build_transport\n"
    assert project_imports(sharing, "node.sharing", False, modules.__contains__) == {"node.loop", "node.transport"}
    trainer = "def build():\n    from node.pipeline import server\n"
    assert project_imports(trainer, "node.trainer", False, modules.__contains__) == {"node.pipeline.server"}


def test_an_upward_import_is_found_however_it_is_written():
    graph = {"node.sharing": {"node.loop"}, "node.trainer": {"node.pipeline.server", "node.files"}}
    assert layering_breaches(graph) == [
        "node.sharing (components) imports node.loop (node): upward",
        "node.trainer (network and policy) imports node.pipeline.server (components): upward",
    ]


def test_an_import_into_another_room_of_the_layer_is_found_unless_the_table_allows_it():
    graph = {
        "node.transport.null": {"node.trainer", "node.transport.base"},
        "node.rollouts.vllm_backend": {"node.model"},
        "node.pipeline.server": {"node.averaging.service", "node.policy"},
    }
    assert layering_breaches(graph) == [
        "node.pipeline.server imports node.policy: inside the layer 'components' the room node.pipeline may import "
        "node.averaging (WITHIN_LAYER)",
        "node.transport.null imports node.trainer: inside the layer 'network and policy' the room node.transport may "
        "import nothing but its own modules (WITHIN_LAYER)",
    ]


def test_a_module_no_layer_places_is_found():
    assert layering_breaches({"node.newroom": {"node.files"}}) == [
        "node.newroom is in no layer of tests/test_layering.py: LAYERS"
    ]


def test_a_cycle_of_any_length_is_found_and_told_as_a_chain():
    graph = {
        "node.averaging.a": {"node.averaging.b", "node.files"},
        "node.averaging.b": {"node.averaging.c"},
        "node.averaging.c": {"node.averaging.a", "node.averaging.c"},
        "node.files": set(),
        "node.model": {"node.warmstart"},
        "node.warmstart": {"node.model"},
    }
    assert import_cycles(graph) == [
        ["node.averaging.a", "node.averaging.b", "node.averaging.c", "node.averaging.a"],
        ["node.model", "node.warmstart", "node.model"],
    ]
    assert import_cycles({"node.averaging.a": {"node.files"}, "node.files": set()}) == []


def test_the_within_layer_table_joins_rooms_of_one_layer():
    for room, allowed in WITHIN_LAYER.items():
        for other in allowed | {room}:
            assert room_of(other) == (other, room_of(room)[1]), f"WITHIN_LAYER: {other} is no room of {room}'s layer"


def test_the_docs_state_the_within_layer_table():
    with open(os.path.join(REPO, "docs", "ARCHITECTURE.md")) as file:
        section = file.read().split("\n## Inside a layer\n", 1)[1].split("\n## ", 1)[0]
    stated = {}
    for row in section.splitlines():
        cells = row.split("|")  # | layer | rooms | what they may import of their layer | why |
        for room in re.findall(r"`([\w.]+)`", cells[2]) if len(cells) == 6 else []:
            assert cells[1].strip() == LAYERS[room_of(room)[1]][0], row
            stated[room] = set(re.findall(r"`([\w.]+)`", cells[3]))
    assert stated == WITHIN_LAYER


def test_test_modules_share_code_through_tests_helpers_only():
    """A test module imports helpers (tests/helpers/) and fixtures (tests/conftest.py, by name), never another test
    module."""
    crossing = []
    for name in sorted(os.listdir(os.path.join(REPO, "tests"))):
        if name.endswith(".py"):
            path = os.path.join(REPO, "tests", name)
            crossing += [
                f"{name} imports {imported}"
                for imported in sorted(imports_of(path))
                if imported.startswith(("tests.test_", "tests.conftest"))
            ]
    assert crossing == []


def imports_of(path: str) -> set[str]:
    found = set()
    for item in ast.walk(ast.parse(open(path).read())):
        if isinstance(item, ast.ImportFrom) and item.module:
            found.add(item.module)
        elif isinstance(item, ast.Import):
            found |= {alias.name for alias in item.names}
    return found
