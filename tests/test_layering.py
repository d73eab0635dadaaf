"""Layers import downward only: what validates a peer's record or carries rollouts loads no model library."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def imported_after(modules: list[str]) -> set[str]:
    code = f"import sys; import {', '.join(modules)}; print(' '.join(sorted(sys.modules)))"
    return set(
        subprocess.run(
            [sys.executable, "-c", code], check=True, cwd=REPO, capture_output=True, text=True
        ).stdout.split()
    )


def test_the_record_validator_transports_and_stats_load_no_model_library():
    loaded = imported_after(["node.transport.records", "node.transport.base", "node.stats", "node.files"])
    assert not loaded & {"transformers", "node.model", "node.state", "node.trainer"}


def test_rollout_data_types_are_torch_free():
    loaded = imported_after(["node.rollouts.base", "node.files"])
    assert "torch" not in loaded and "node.trainer" not in loaded


def test_choosing_own_and_peers_rollouts_is_torch_free():
    """Which rollouts a node trains on is decided without a model library (grading sits with the tasks)."""
    loaded = imported_after(["node.sharing", "node.local_rollouts", "node.compute", "node.teachers"])
    assert "torch" not in loaded and "node.trainer" not in loaded


# The layers, lowest first (docs/ARCHITECTURE.md explains each). A module may import from its own layer
# and the layers below it, never from one above. A module missing here fails the test: place it.
LAYERS = [
    ("wire", ["protocol"]),
    ("foundations", ["node", "node.config", "node.files", "node.aio", "node.display"]),
    ("data", ["node.rollouts.base", "node.tasks", "node.stats", "node.weights", "node.compute", "node.device"]),
    (
        "network and policy",
        ["node.transport", "node.model", "node.warmstart", "node.state", "node.trainer", "node.rollouts"],
    ),
    (
        "components",
        [
            "node.policy",
            "node.local_rollouts",
            "node.sharing",
            "node.teachers",
            "node.evaluation",
            "node.telemetry",
            "node.averaging",
            "node.pipeline",
        ],
    ),
    ("node", ["node.loop", "node.dashboard"]),
    ("commands", ["node.cli", "node.commands", "node.runtime", "node.pipeline.commands", "node.dashboard.commands"]),
]


def layer_of(module: str) -> int:
    """The layer of the longest prefix of `module` in LAYERS."""
    # "node": its __init__ only
    best = max(
        (
            (len(prefix), rank)
            for rank, (_, prefixes) in enumerate(LAYERS)
            for prefix in prefixes
            if module == prefix or (module.startswith(prefix + ".") and prefix != "node")
        ),
        default=None,
    )
    assert best is not None, f"{module} is in no layer of tests/test_layering.py: LAYERS"
    return best[1]


def project_imports(path: str, module: str) -> set[str]:
    """Every node.* / protocol.* module that `path` imports, at the top or inside a function."""
    import ast

    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for item in ast.walk(ast.parse(open(path).read())):
        if isinstance(item, ast.Import):
            found |= {alias.name for alias in item.names}
        elif isinstance(item, ast.ImportFrom):
            base = item.module or ""
            if item.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - item.level + 1] + ([base] if base else []))
            found.add(base)
    return {name for name in found if name.split(".")[0] in ("node", "protocol")}


def test_every_module_imports_only_its_own_layer_and_those_below():
    upward = []
    for top in ("node", "protocol"):
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                module = os.path.relpath(path, REPO)[: -len(".py")].replace(os.sep, ".").removesuffix(".__init__")
                rank = layer_of(module)
                upward += [
                    f"{module} ({LAYERS[rank][0]}) imports {imported} ({LAYERS[layer_of(imported)][0]})"
                    for imported in sorted(project_imports(path, module))
                    if layer_of(imported) > rank
                ]
    assert upward == []


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
    import ast

    found = set()
    for item in ast.walk(ast.parse(open(path).read())):
        if isinstance(item, ast.ImportFrom) and item.module:
            found.add(item.module)
        elif isinstance(item, ast.Import):
            found |= {alias.name for alias in item.names}
    return found


def test_no_two_modules_import_each_other():
    """Not even inside functions: a pair that needs each other is one job split in two, or a third module missing below
    both."""
    graph = {}
    for top in ("node", "protocol"):
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            for name in (n for n in files if n.endswith(".py")):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, REPO)[: -len(".py")].replace(os.sep, ".").removesuffix(".__init__")
                graph[module] = {m for m in project_imports(path, module) if m != module}
    mutual = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets if a in graph.get(b, ())})
    assert mutual == []
