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
