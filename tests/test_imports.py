"""The import graph of tfscale/, read from the source: no circle anywhere,
and the private layer (tfscale/_private/) at the bottom, importing nothing of
tfscale but itself."""

import ast
import os

from multiworker import REPO_ROOT

PACKAGE = os.path.join(REPO_ROOT, "tfscale")


def modules():
    """{module name: path} of every module and package of tfscale."""
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                dotted = os.path.relpath(path, REPO_ROOT)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imports(path, known):
    """The tfscale modules `path` imports: `from P import x` is P.x where that
    is a module, else P (a name its `__init__` defines)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tfscale"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in known else node.module)
    return found & set(known)


def graph():
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def circles(edges):
    """Every circle of `edges`, each once, as a list of modules."""
    found, seen = [], set()

    def walk(start, node, path):
        for following in sorted(edges[node]):
            if following == start and frozenset(path) not in seen:
                seen.add(frozenset(path))
                found.append(path + [start])
            elif following not in path and following > start:
                walk(start, following, path + [following])

    for start in sorted(edges):
        walk(start, start, [start])
    return found


def test_the_checker_finds_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == [["a", "b", "c", "a"]]


def test_no_import_circle_in_tfscale():
    found = circles(graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_private_layer_imports_nothing_of_tfscale():
    outside = {name: sorted(d for d in deps if not d.startswith("tfscale._private"))
               for name, deps in graph().items() if name.startswith("tfscale._private")}
    assert not any(outside.values()), outside
