"""The package's floors (docs/design.md, "Layers, folder by folder"): megalite's import graph,
every import counted (function-level ones too), has no cycle; the bottom and the loop stay where
the architecture puts them; the memory probe's process-level effects end with its block."""

import ast
import os
import sys

import torch

from pretrain_utils import ROOT

PKG = os.path.join(ROOT, "megalite")


def import_graph():
    """module -> the megalite modules it imports anywhere in its source (not its own package's
    ``__init__``, which a submodule's import runs anyway)."""
    mods = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, ".")
                mods[rel.removesuffix(".__init__")] = os.path.join(d, f)

    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for m, path in mods.items():
        base = m.split(".") if path.endswith("__init__.py") else m.split(".")[:-1]
        out = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
                names = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                r = resolve(n) if n.split(".")[0] == "megalite" else None
                if r and r != m and not (mods[r].endswith("__init__.py") and m.startswith(r + ".")):
                    out.add(r)
        graph[m] = out
    return graph


def find_cycle(graph):
    """One cycle as a list of modules, or None (depth-first search, colouring)."""
    state, stack = {}, []

    def visit(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_find_cycle_sees_a_lazy_two_module_cycle():
    assert find_cycle({"a": {"b"}, "b": {"a"}, "c": set()}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_megalite_imports_are_acyclic():
    graph = import_graph()
    assert len(graph) > 50 and "megalite.pipeline_parallel.schedules" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    assert graph["megalite.config"] == set()  # the bottom floor
    assert graph["megalite.torch_private"] == set()
    assert "megalite.planner" not in graph["megalite.training"]


def test_peak_memory_probe_restores_the_process():
    """The CPU probe redirects fd 2 and switches on c10's count of frees on every thread, for its
    block only (megalite/memory.py, PeakTensorMemory): both are as before once it ends."""
    from megalite.memory import CountingCPUFrees, PeakTensorMemory

    before = os.fstat(2)
    with CountingCPUFrees() as c:
        flag = c.flag
    was = None if flag is None else flag.value
    with PeakTensorMemory("cpu") as probe:
        x = torch.ones(1 << 18)  # 1 MiB
        assert flag is None or flag.value
        del x
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
    assert flag is None or flag.value == was
    assert probe.peak_bytes >= probe.baseline + (1 << 20)
    sys.stderr.write("")  # still writable


def private_torch_uses(source: str) -> list:
    """(line, what) for each private torch API or ctypes use in ``source``: an import of
    ``ctypes`` or of an underscored torch module or name, and an underscored attribute of anything
    bound to torch (imports, aliases, assignments: ``_aten = torch.ops.aten; _aten._x``); torch's
    documented ``torch._foreach_*`` is allowed, and so are dunders (``torch.__version__``)."""
    tree = ast.parse(source)

    def private(name):
        return name.startswith("_") and not name.startswith(("__", "_foreach_"))

    def root(node):  # the name an attribute chain starts from, and the chain
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        return (node.id if isinstance(node, ast.Name) else None), parts[::-1]

    torch_names, hits = {"torch"}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "ctypes" or (a.name.split(".")[0] == "torch" and any(
                        private(p) for p in a.name.split("."))):
                    hits.append((node.lineno, "import " + a.name))
                if a.name.split(".")[0] == "torch":
                    torch_names.add(a.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                if any(private(p) for p in node.module.split(".") + [a.name]):
                    hits.append((node.lineno, f"from {node.module} import {a.name}"))
                torch_names.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module == "ctypes":
            hits.append((node.lineno, "from ctypes import"))
    for _ in range(2):  # aliases of aliases
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and root(node.value)[0] in torch_names:
                torch_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    attrs = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    inner = {id(n.value) for n in attrs}
    for node in attrs:
        name, parts = root(node)
        if id(node) not in inner and name in torch_names and any(private(p) for p in parts):
            hits.append((node.lineno, ".".join([name] + parts)))  # each whole chain once
    return sorted(set(hits))


def test_private_use_scan_sees_aliases():
    assert private_torch_uses(
        "import ctypes\nimport torch.serialization as ser\nfrom torch._utils import f\n"
        "from torch.autograd import Variable\n_aten = torch.ops.aten\nser._save(x)\n"
        "_aten._sdpa(q)\nVariable._execution_engine\ntorch._C._profiler.E\n"
        "torch._foreach_mul_(xs, 2)\ntorch.__version__\nself._x.y\n") == [
        (1, "import ctypes"), (3, "from torch._utils import f"), (6, "ser._save"),
        (7, "_aten._sdpa"), (8, "Variable._execution_engine"), (9, "torch._C._profiler.E")]


def test_private_torch_apis_only_in_the_shim():
    """Private torch APIs and ctypes appear only in megalite/torch_private.py, where each says why
    no public API serves."""
    found = []
    for d, _, files in os.walk(PKG):
        for f in sorted(files):
            path = os.path.join(d, f)
            if f.endswith(".py") and os.path.relpath(path, PKG) != "torch_private.py":
                with open(path, encoding="utf-8") as src:
                    found += [f"{os.path.relpath(path, ROOT)}:{line}: {what}"
                              for line, what in private_torch_uses(src.read())]
    assert not found, "private torch APIs outside megalite/torch_private.py:\n" + "\n".join(found)
