"""The house's rules, checked on the source: each room imports only the rooms
below it, only store/ and io/ know which backend or engine they are, and the
adapters use public modules of the core."""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
CORE = os.path.join(ROOT, "globalshard")

#: What each room of the core may import from the core (besides its own modules
#: and the pure modules: errors, geometry, layout, dtypes, comm, planner).
PURE = {"errors", "geometry", "layout", "dtypes", "comm", "planner"}
ALLOWED = {
    "format": PURE - {"planner", "comm", "layout"},
    "store": PURE | {"format"},
    "io": PURE | {"format", "store"},
    "checkpoint": PURE | {"format", "store", "io", "shared"},
    "hf": PURE | {"checkpoint"},
    "tiers": PURE | {"format", "store", "io", "checkpoint", "shared"},
}
#: The impure half: no module of it grows past this many lines (HOUSE.md).
IMPURE_ROOMS, MAX_LINES = ("store", "io", "io/localio", "checkpoint", "hf", "tiers"), 400


def imports_of(path):
    tree = ast.parse(open(path).read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def modules(room):
    directory = os.path.join(CORE, room)
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".py"))


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_each_room_imports_only_the_rooms_below_it(room):
    bad = []
    for path in modules(room):
        for name in imports_of(path):
            parts = name.split(".")
            if parts[0] != "globalshard" or len(parts) < 2 or parts[1] == room:
                continue
            if parts[1] not in ALLOWED[room]:
                bad.append(f"{os.path.relpath(path, ROOT)} imports {name}")
    assert bad == []


def test_the_format_does_no_io():
    for path in modules("format"):
        names = set(imports_of(path))
        assert not names & {"tensorstore", "os", "shutil", "fcntl"}, path


def test_only_store_and_io_name_a_backend_or_an_engine():
    backends = {"LocalStore", "KvStore", "LocalEngine", "TensorStoreEngine"}
    bad = []
    for room in ("checkpoint", "hf", "tiers"):
        for path in modules(room):
            tree = ast.parse(open(path).read(), path)
            used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            bad += [f"{os.path.relpath(path, ROOT)} uses {b}" for b in sorted(used & backends)]
    for name in ("cli.py", "shared.py"):
        path = os.path.join(CORE, name)
        tree = ast.parse(open(path).read(), path)
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        bad += [f"globalshard/{name} uses {b}" for b in sorted(used & backends)]
    assert bad == []


def test_no_module_of_the_impure_half_is_over_400_lines():
    long = {os.path.relpath(p, ROOT): n for room in IMPURE_ROOMS for p in modules(room)
            if (n := len(open(p).read().splitlines())) > MAX_LINES}
    assert long == {}


def test_adapters_import_public_modules_of_the_core_only():
    internal = {"globalshard.api", "globalshard.storage", "globalshard.metadata", "globalshard.io",
                "globalshard.store", "globalshard.checkpoint", "globalshard.format"}
    bad = []
    for package in ("globalshard_torch", "globalshard_jax"):
        directory = os.path.join(ROOT, "backends", package)
        for name in sorted(os.listdir(directory)):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                bad += [f"{package}/{name} imports {m}" for m in imports_of(path)
                        if any(m == i or m.startswith(i + ".") for i in internal)]
    assert bad == []


def test_no_module_of_the_package_or_its_adapters_imports_pickle():
    """A checkpoint is JSON and raw arrays, and so are the messages to a writer
    process: nothing the package reads can make it run code."""
    bad = []
    for directory in (CORE, os.path.join(ROOT, "backends")):
        for d, _, names in os.walk(directory):
            for name in sorted(n for n in names if n.endswith(".py")):
                path = os.path.join(d, name)
                bad += [f"{os.path.relpath(path, ROOT)} imports {m}" for m in imports_of(path)
                        if m.split(".")[0] in ("pickle", "marshal", "shelve", "dill", "cloudpickle")
                        or m == "multiprocessing.reduction"]
    assert bad == []
