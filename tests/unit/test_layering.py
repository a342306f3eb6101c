"""The import layering of src/deltacp (docs/design.md, "Layers of the package"), checked on the source text.

Every module under src/deltacp is parsed with `ast`; every import counts, at module level or inside a function
(a lazy import still ties the two modules together): `import x.y`, `from x import y` (y a submodule or a name),
relative imports resolved against the importing module's package. Importing a submodule is an edge to that
submodule only (not to its parent packages' __init__). Imports built at run time (importlib) are not seen.

    (a) no import cycle among the modules of deltacp;
    (b) imports point down only, by the package's rank below: a module imports modules of its own rank or lower;
        deltacp.testing is for tests and benches, and no library module imports it;
    (c) ops.fused does not import each other with ops.gdn.triton nor with ops.lm_head (one of a pair may use the
        other, not both: the head ops import their Triton kernels from ops.fused lazily);
    (d) ops.gdn and ops.lm_head (two op families) import nothing of each other.

Every violation is listed in the failure message as `file:line  importer -> imported`.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT = "deltacp"
TESTING = "deltacp.testing"
# a module's rank is its package's (or its own) below; the package's __init__ (`deltacp`) is on top
RANKS: dict[str, int] = {
    "deltacp.ops": 0,
    "deltacp.distributed": 1,
    "deltacp.parallel": 2,
    "deltacp.families.registry": 3,  # the families' registry, beside their homes: names and records only
    "deltacp.models": 3,
    "deltacp.batching": 3,
    "deltacp.losses": 3,
    "deltacp.checkpoint_io": 3,
    "deltacp.families": 4,
    "deltacp.integrations": 4,
    "deltacp.train": 4,
    "deltacp.config": 4,
    "deltacp.demo": 4,
}
TOP = 5
# pairs of subpackages that may not both import the other
NOT_MUTUAL: tuple[tuple[str, str], ...] = (("deltacp.ops.fused", "deltacp.ops.gdn.triton"),
                                           ("deltacp.ops.fused", "deltacp.ops.lm_head"))
# pairs of subpackages of which neither imports the other
INDEPENDENT: tuple[tuple[str, str], ...] = (("deltacp.ops.gdn", "deltacp.ops.lm_head"),)


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}  {self.importer} -> {self.imported}"


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def modules() -> dict[str, Path]:
    """{dotted module name: file} of every module of the package (a package by its __init__.py)."""
    out = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(target: str, known: dict[str, Path]) -> str | None:
    """The deltacp module `target` names (the longest known module it starts with), or None if it is outside."""
    while target:
        if target in known:
            return target
        target = target.rpartition(".")[0]
    return None


def imports(name: str, source: str, known: dict[str, Path], file: str) -> list[Edge]:
    """Every import of a deltacp module by module `name` (source text `source`), wherever it stands in the file."""
    package = name if file.endswith("__init__.py") else name.rpartition(".")[0]
    edges = []
    for node in ast.walk(ast.parse(source, filename=file)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from pkg import sub` imports the submodule pkg.sub; `from mod import name` imports mod
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                       for alias in node.names]
        for target in targets:
            resolved = _resolve(target, known) if _within(target, ROOT) else None
            if resolved is not None and resolved != name:
                edges.append(Edge(name, resolved, file, node.lineno))
    return edges


def import_graph() -> list[Edge]:
    known = modules()
    edges = [edge for name, path in known.items()
             for edge in imports(name, path.read_text(), known, str(path.relative_to(SRC.parent)))]
    return sorted(set(edges), key=lambda e: (e.file, e.line, e.imported))  # `from m import a, b`: one edge


def rank(name: str) -> int | None:
    """The module's rank; None for a module of no ranked package (a new top-level module: give it a rank)."""
    if name == ROOT:
        return TOP
    return next((r for prefix, r in RANKS.items() if _within(name, prefix)), None)


def components(edges: list[Edge]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan): each holds at least one cycle."""
    graph: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        graph[e.importer].add(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []

    def connect(v: str) -> None:  # recursive: the graph is a few hundred edges
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def shortest_cycle(edges: list[Edge], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first back to it)."""
    start = min(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while start not in parent:
        reached = []
        for e in edges:
            if e.importer in frontier and e.imported in component and e.imported not in parent:
                parent[e.imported] = e.importer
                reached.append(e.imported)
        frontier = reached
    path = [start]
    while len(path) == 1 or path[-1] != start:
        path.append(parent[path[-1]])
    return path[::-1]


def cycle_report(edges: list[Edge]) -> list[str]:
    """Per cycle group: its modules, one cycle, and every import inside it (each a candidate to cut)."""
    out = []
    for component in components(edges):
        inside = [e for e in edges if e.importer in component and e.imported in component]
        out.append(f"import cycle among {len(component)} modules: " + " -> ".join(shortest_cycle(edges, component))
                   + "\n      imports inside the group:\n        " + "\n        ".join(map(str, inside)))
    return out


def moved_aliases() -> set[str]:
    """Modules left at a moved module's old path: their whole body makes the old name the new module
    (`sys.modules[__name__] = ...`); not a dependency of the old package on the new one."""
    return {name for name, path in modules().items() if "sys.modules[__name__] = " in path.read_text()}


def layer_violations(edges: list[Edge]) -> list[str]:
    out = []
    aliases = moved_aliases()
    for e in edges:
        if _within(e.importer, TESTING) or e.importer in aliases:
            continue  # test support may import anything of the library; an alias is the module it names
        if _within(e.imported, TESTING):
            out.append(f"{e}  (library module imports deltacp.testing, which is for tests and benches)")
        elif rank(e.importer) is None or rank(e.imported) is None:
            out.append(f"{e}  (a module of no ranked package: add it to RANKS)")
        elif rank(e.imported) > rank(e.importer):
            out.append(f"{e}  (rank {rank(e.importer)} imports rank {rank(e.imported)})")
    return out


def mutual_violations(edges: list[Edge]) -> list[str]:
    out = []
    for a, b in NOT_MUTUAL:
        ab = [e for e in edges if _within(e.importer, a) and _within(e.imported, b)]
        ba = [e for e in edges if _within(e.importer, b) and _within(e.imported, a)]
        if ab and ba:
            out.append(f"{a} and {b} import each other:\n      " + "\n      ".join(str(e) for e in ab + ba))
    return out


def independence_violations(edges: list[Edge]) -> list[str]:
    return [f"{e}  ({a} and {b} are independent op families)" for a, b in INDEPENDENT for e in edges
            if _within(e.importer, a) and _within(e.imported, b) or _within(e.importer, b) and _within(e.imported, a)]


def _fail_on(violations: list[str], what: str) -> None:
    assert not violations, f"{len(violations)} {what}:\n" + "\n".join("  " + v for v in violations)


def test_the_parser_sees_every_kind_of_import():
    """Module-level and function-level imports, `import a.b`, `from a import name`, `from pkg import submodule`,
    relative imports (from a module and from a package's __init__), resolved to the deltacp module they load."""
    known = {m: Path() for m in ("deltacp", "deltacp.a", "deltacp.a.b", "deltacp.a.c", "deltacp.a.d", "deltacp.e")}
    source = (
        "import os, deltacp.a.b\n"
        "from deltacp.a.c import thing\n"
        "from deltacp.a import d, not_a_module\n"
        "from . import c\n"
        "from .. import e\n"
        "from ..e import name as other\n"
        "def f():\n"
        "    import torch\n"
        "    from deltacp.e.missing import x\n")
    edges = [(e.imported, e.line) for e in imports("deltacp.a.x", source, known, "x.py")]
    assert sorted(edges) == sorted([("deltacp.a.b", 1), ("deltacp.a.c", 2), ("deltacp.a.d", 3), ("deltacp.a", 3),
                                    ("deltacp.a.c", 4), ("deltacp.e", 5), ("deltacp.e", 6), ("deltacp.e", 9)])
    # in a package's __init__, `from . import c` is the package's own submodule
    assert [e.imported for e in imports("deltacp.a", "from . import c\n", known, "a/__init__.py")] == ["deltacp.a.c"]
    assert {(e.importer, e.imported) for e in import_graph()} >= {
        ("deltacp.models.parallelize", "deltacp.parallel.style"), ("deltacp.ops.gdn.backends", "deltacp.ops.gdn.triton"),
        ("deltacp.ops.lm_head.kernels", "deltacp.ops.fused.token_logprobs")}


def test_no_import_cycles():
    _fail_on(cycle_report(import_graph()), "import cycles among deltacp modules")


def test_imports_point_down():
    _fail_on(layer_violations(import_graph()), "imports that point up (or into deltacp.testing)")


def test_fused_and_gdn_triton_do_not_import_each_other():
    _fail_on(mutual_violations(import_graph()), "pairs of ops subpackages that import each other")


def test_op_families_are_independent():
    _fail_on(independence_violations(import_graph()), "imports between independent op families")


def test_ops_layering():
    """What deltacp.ops alone must satisfy: no cycle through an ops module, no import out of ops."""
    edges = import_graph()
    ops = [e for e in edges if _within(e.importer, "deltacp.ops")]
    _fail_on(cycle_report(ops) + layer_violations(ops) + mutual_violations(ops) + independence_violations(ops),
             "layering violations in deltacp.ops")


# The CP algorithms know no model family and no parameter of one: the family's view (`deltacp.families`) hands them
# everything (issue 41). Words matched case-insensitively in the source of deltacp.parallel, comments included.
FAMILY_WORDS = ("qwen", "olmo", "kimi", "nemotron", "granite", "falcon", "bamba", "bailing", "beta", "a_log",
                "dt_bias", "l2norm", "qkv", "in_proj", "q_norm", "k_norm")


def test_cp_algorithms_name_no_family_and_no_family_parameter():
    import re

    found = []
    for path in sorted((SRC / ROOT / "parallel").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for word in FAMILY_WORDS:
                if re.search(rf"(?<![a-z]){re.escape(word)}", line, re.IGNORECASE):
                    found.append(f"{path.relative_to(SRC)}:{n}  {word!r}: {line.strip()}")
    assert not found, "deltacp.parallel names a family or its parameters:\n" + "\n".join(found)


def test_families_and_models_do_not_import_each_other():
    """The homes register in the registry beside them; what applies CP to a model (deltacp.models) reads the registry
    and no home, and no home imports deltacp.models (issue 49)."""
    bad = [e for e in import_graph()
           if (_within(e.importer, "deltacp.models") and _within(e.imported, "deltacp.families")
               and not _within(e.imported, "deltacp.families.registry"))
           or (_within(e.importer, "deltacp.families") and _within(e.imported, "deltacp.models"))]
    _fail_on([str(e) for e in bad], "imports between deltacp.families and deltacp.models")
