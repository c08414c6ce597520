"""The import rule of docs/architecture.md, checked on the source (ast, no
imports): a module imports only its own layer or a lower one, and there is
no import cycle between modules. Every import counts, including the ones
inside functions and under ``if TYPE_CHECKING:``: a lazy import is still a
dependency."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Module prefix -> layer, top (1) to bottom (6). The longest matching prefix
# wins. A module may import modules of its own layer or of a higher number.
LAYERS: dict[str, int] = {
    # 1. entry points and the composition root
    "controlplane.cli": 1,
    "controlplane.server": 1,  # the composition root (app.py) and its wiring
    "controlplane.startup": 1,  # the start's checks and failures (serve, demo, migrate)
    "controlplane.__main__": 1,
    "controlplane.protogen": 1,  # developer tool: regenerates controlplane/_proto
    "controlplane.analysis": 1,  # offline tool beside the stack, reached from the CLI
    "controlplane.sim": 1,  # simulation harness: drives the service like the gRPC layer does
    "controlplane.fakeengine": 1,  # a modelled engine over HTTP, on the sim's engine model
    "controlplane.loadtest": 1,  # load generator against a running control plane
    "burstgate_client.sidecar": 1,  # the HTTP sidecar in front of an engine, on the SDK
    "burstgate_client.litellm": 1,  # LiteLLM proxy plug-in, on the SDK and sidecar
    "burstgate_client": 1,  # the client distribution's root: its version
    # 2. adapters: gRPC servicers, clients, telemetry, generated protobuf
    "controlplane.rpc": 2,
    "controlplane.integrations": 2,  # gateways' APIs served (Envoy's RLS, on the service)
    "burstgate_client.protoclient": 2,  # the thin client: protobuf in, protobuf out
    "burstgate_client.admin": 2,  # the operators' client and authenticated channels
    "burstgate_client.redirects": 2,  # NOT_OWNER answers, read by every client
    "burstgate_client.sdk": 2,  # the client SDK: on the generated protobuf and the redirects
    "burstgate_client._proto": 2,  # generated: the API's stubs (the server's too)
    "controlplane.telemetry": 2,
    "controlplane._proto": 2,
    # 3. use cases
    "controlplane.service": 3,
    "controlplane.ledger": 3,
    "controlplane.auth": 3,
    "controlplane.configfile": 3,
    "controlplane.ha": 3,  # scale-out: the coordinator (use case) over its lease store
    # 4. storage: all SQL
    "controlplane.store": 4,
    "controlplane.ha.store": 4,  # the lease and member tables, and fence()
    # 5. domain: pure types, errors, validation, settings
    "controlplane.domain": 5,
    "controlplane.settings": 5,
    "controlplane.clock": 5,
    "burstgate_client.errors": 5,  # the client's own argument errors
    "burstgate_client.edge": 5,  # the API's edge rules, as the client checks them
    "controlplane.ha.rendezvous": 5,  # pure: HRW hashing
    "controlplane.ha.cells": 5,  # pure: pool -> cell
    "controlplane": 5,  # the package root holds only __version__
    # 6. the Cython fast path
    "fastpath": 6,
}
LAYER_NAMES = {1: "entry", 2: "adapters", 3: "use cases", 4: "storage", 5: "domain", 6: "fastpath"}
# Each top-level package and the folder it lives in (the client wing is its
# own distribution, under clients/python).
SOURCE_ROOTS = {
    "controlplane": ROOT,
    "fastpath": ROOT,
    "burstgate_client": ROOT / "clients" / "python",
}
PACKAGES = tuple(SOURCE_ROOTS)


def layer_of(module: str) -> int:
    best = ""
    for prefix in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    if not best:
        raise KeyError(module)
    return LAYERS[best]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    """Every hand-written module of the three packages."""
    out: dict[str, Path] = {}
    for package, root in SOURCE_ROOTS.items():
        for path in sorted((root / package).rglob("*.py")):
            if "_proto" in path.parts:  # generated
                continue
            out[module_name(path, root)] = path
    return out


def imports(path: Path, name: str, known: set[str]) -> Iterator[tuple[str, int]]:
    """(imported module, line) for each import of our own packages."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                # `from pkg import mod` imports the module pkg.mod
                yield (sub if sub in known else target), node.lineno


def graph() -> dict[str, list[tuple[str, int]]]:
    modules = source_modules()
    known = set(modules)
    edges: dict[str, list[tuple[str, int]]] = {}
    for name, path in modules.items():
        edges[name] = [
            (target, line)
            for target, line in imports(path, name, known)
            if target.split(".")[0] in PACKAGES and target != name
        ]
    return edges


def test_every_module_has_a_layer() -> None:
    for name in source_modules():
        layer_of(name)  # raises KeyError for a module outside the table


def test_no_import_runs_up_a_layer() -> None:
    modules = source_modules()
    problems = []
    for name, targets in graph().items():
        mine = layer_of(name)
        for target, line in targets:
            theirs = layer_of(target)
            if theirs < mine:
                problems.append(
                    f"{modules[name].relative_to(ROOT)}:{line}: {name} ({LAYER_NAMES[mine]}) "
                    f"imports {target} ({LAYER_NAMES[theirs]})"
                )
    assert not problems, "imports that run up a layer:\n" + "\n".join(problems)


def strongly_connected(edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(edges.get(root, ())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(edges.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_cycles() -> None:
    edges = {name: sorted({t for t, _ in targets}) for name, targets in graph().items()}
    cycles = strongly_connected(edges)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": ["b"], "b": ["a"]}, [["a", "b"]]),
        ({"a": ["b"], "b": ["c"], "c": []}, []),
        ({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}, [["a", "b", "c"]]),
    ],
)
def test_cycle_finder(edges: dict[str, list[str]], expected: list[list[str]]) -> None:
    assert strongly_connected(edges) == expected


def test_layer_table_orders_prefixes() -> None:
    assert layer_of("controlplane.cli.tenant") == 1
    assert layer_of("controlplane.store.config") == 4
    assert layer_of("controlplane.settings") == 5
    assert layer_of("fastpath.codes") == 6


def test_only_the_facade_and_the_dispatcher_start_a_dispatch() -> None:
    """Inside the service, a part that frees capacity returns what it freed
    and the façade calls the dispatcher; a part calling ``dispatch`` itself
    would make the release order depend on who freed what (and loops)."""
    allowed = {"admission.py", "dispatcher.py"}
    offenders = []
    for path in sorted((ROOT / "controlplane" / "service").glob("*.py")):
        if path.name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "dispatch"
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_the_client_wing_imports_only_itself() -> None:
    """burstgate_client is its own distribution (clients/python): an import
    of the server's there would fail wherever only the client is installed."""
    modules = source_modules()
    offenders = [
        f"{modules[name].relative_to(ROOT)}:{line}: {name} imports {target}"
        for name, targets in graph().items()
        if name.split(".")[0] == "burstgate_client"
        for target, line in targets
        if target.split(".")[0] != "burstgate_client"
    ]
    assert offenders == []
