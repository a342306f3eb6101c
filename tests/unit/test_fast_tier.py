"""The fast tier (pyproject's `fast` marker; `bash scripts/test.sh -m fast`) touches every package of deltacp, and
runs ranks at least once.

Read from the test sources (no collection): a fast test is a module with `pytestmark = pytest.mark.fast`, a function
decorated `@pytest.mark.fast` or a parametrized case `pytest.param(..., marks=pytest.mark.fast)`. What it touches:
the deltacp modules imported by its module at the top, by the function, by the module's functions it names (the
workers it hands to run_distributed, their helpers, in turn), by code strings it names (run in a subprocess), and by
the tests/ helper modules it imports (helpers.py, integ_cases.py). The packages: each subpackage of deltacp and of
deltacp.ops (a new one needs a fast test).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src"
FAST = "pytest.mark.fast"


def packages() -> set[str]:
    out = set()
    for init in (SRC / "deltacp").rglob("__init__.py"):
        parts = init.parent.relative_to(SRC).parts
        if (len(parts) == 2 and parts[1] != "ops") or (len(parts) == 3 and parts[1] == "ops"):
            out.add(".".join(parts))
    return out


def _fast(node: ast.AST) -> bool:
    return FAST in {ast.unparse(n) for n in ast.walk(node) if isinstance(n, ast.Attribute)}


class Module:
    def __init__(self, path: Path):
        self.tree = ast.parse(path.read_text())
        self.defs = {n.name: n for n in self.tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        self.strings = {t.id: n.value for n in self.tree.body if isinstance(n, ast.Assign)
                        for t in n.targets if isinstance(t, ast.Name)}
        self.top = [n for n in self.tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]

    def marked(self) -> bool:
        return any(isinstance(n, ast.Assign) and _fast(n.value)
                   and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets) for n in self.tree.body)

    def fast_tests(self) -> list[ast.AST]:
        if self.marked():
            return list(self.tree.body)
        return [n for n in self.tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")
                and any(_fast(d) for d in n.decorator_list)]

    def reach(self, roots: list[ast.AST]) -> list[ast.AST]:
        """The roots, the module functions and code strings they name, and so on."""
        seen, todo, out = set(), list(roots), []
        while todo:
            node = todo.pop()
            out.append(node)
            for name in {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}:
                if name in seen:
                    continue
                seen.add(name)
                if name in self.defs:
                    todo.append(self.defs[name])
                elif name in self.strings:
                    for s in ast.walk(self.strings[name]):
                        if isinstance(s, ast.Constant) and isinstance(s.value, str) and "import" in s.value:
                            try:
                                todo.append(ast.parse(s.value.replace("{{", "{").replace("}}", "}")))
                            except SyntaxError:
                                pass
        return out


def _imported(nodes: list[ast.AST]) -> set[str]:
    names = set()
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Import):
                names |= {a.name for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                names |= {n.module if a.name == "*" else f"{n.module}.{a.name}" for a in n.names}
    return names


def _is_module(name: str) -> bool:
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _exports() -> dict[str, str]:
    """deltacp's public names -> their modules: the lazy table `_PUBLIC` of deltacp/__init__.py (a literal dict)."""
    for node in ast.parse((SRC / "deltacp" / "__init__.py").read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign)
                                                                      else None)
        if isinstance(target, ast.Name) and target.id == "_PUBLIC":
            return ast.literal_eval(node.value)
    raise AssertionError("deltacp/__init__.py has no _PUBLIC table of its exports")


def _deltacp_modules(names: set[str]) -> set[str]:
    """The deltacp modules these import names are (`from deltacp import X`: the module deltacp takes X from), read
    from the sources: importing them here could fix Triton's mode before a test picks it."""
    exports = _exports()
    out = set()
    for name in names:
        if name != "deltacp" and not name.startswith("deltacp."):
            continue
        head, _, attr = name.rpartition(".")
        out.add(name if _is_module(name) else exports.get(attr, head) if head == "deltacp" else head)
    return out


def fast_tier(tests: Path = TESTS) -> tuple[dict[str, set[str]], set[str]]:
    """Per fast test module (path relative to `tests`): the deltacp modules its fast tests touch; the modules whose
    fast tests name run_distributed."""
    local = {p.stem: p for p in tests.rglob("*.py")}
    touched, spawning = {}, set()
    for path in sorted(tests.rglob("test_*.py")):
        if path.resolve() == Path(__file__).resolve():  # its made-up tree's imports are not tests
            continue
        module = Module(path)
        fast = module.fast_tests()
        if not fast:
            continue
        nodes = module.top + module.reach(fast)
        names = _imported(nodes)
        for helper in {n.split(".")[0] for n in names} & local.keys() - {path.stem}:
            names |= _imported([Module(local[helper]).tree])
        rel = str(path.relative_to(tests))
        touched[rel] = _deltacp_modules(names)
        if "run_distributed" in {n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name)}:
            spawning.add(rel)
    return touched, spawning


def test_the_fast_tier_touches_every_package_and_spawns_ranks():
    touched, spawning = fast_tier()
    reached = set().union(*touched.values())
    missing = sorted(p for p in packages() if not any(m == p or m.startswith(p + ".") for m in reached))
    assert not missing, f"packages no fast test imports (mark one of their tests `@pytest.mark.fast`): {missing}"
    assert spawning, "no fast test runs ranks (run_distributed)"


_WORKER = '''
import pytest
from deltacp.distributed.launch import run_distributed
import cases

CODE = """
from deltacp.ops.fused import conv
"""


def worker(rank, world):
    helper()


def helper():
    from deltacp.integrations import shard_collated_batch


@pytest.mark.fast
def test_fast():
    run_distributed(worker, 2)


@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.fast), 2])
def test_one_fast_case(n):
    run(CODE)


def test_slow():
    from deltacp.train import trainer
'''


def test_the_reader_on_a_made_up_tree(tmp_path):
    """Module marks, function marks and marked cases; a worker's helper's import and a code string's count, a slow
    test's does not; `from deltacp import X` is X's module; a tests/ helper module's imports count."""
    (tmp_path / "unit").mkdir()
    (tmp_path / "unit" / "test_a.py").write_text("import pytest\nfrom deltacp import shard_batch_for_cp\n\n"
                                                 "pytestmark = pytest.mark.fast\n\n\ndef test_x():\n    pass\n")
    (tmp_path / "unit" / "test_b.py").write_text("from deltacp.train import config\n\n\ndef test_y():\n    pass\n")
    (tmp_path / "unit" / "test_c.py").write_text(_WORKER)
    (tmp_path / "cases.py").write_text("def build():\n    from deltacp.testing.hf import byte_tokenizer\n")
    touched, spawning = fast_tier(tmp_path)
    assert touched == {"unit/test_a.py": {"deltacp.batching"},
                       "unit/test_c.py": {"deltacp.distributed.launch", "deltacp.integrations",
                                          "deltacp.ops.fused.conv", "deltacp.testing.hf"}}
    assert spawning == {"unit/test_c.py"}
