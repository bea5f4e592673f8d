"""The package's layering, read from the source: grappler_ext never imports tf_memsafe, its modules
import each other without a cycle, and no module outgrows the size the style guide allows.

Imports are read with ``ast`` (inside functions too: a lazy import is still an arrow), resolved to
modules: ``from grappler_ext.splitter import rules`` is an arrow to ``grappler_ext.splitter.rules``.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "grappler_ext"
# Rule tables may be long: one entry per op type.
RULE_TABLES = {"grappler_ext.splitter.rules", "grappler_ext.memory_rules"}
MAX_LINES = 1000
MAX_DRIVER_LINES = 700


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: pathlib.Path) -> set[str]:
    """The modules ``path`` imports (absolute names; a name imported from a package resolved to its
    submodule where there is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


def test_grappler_ext_never_imports_tf_memsafe():
    upward = {name: sorted(m for m in imports(path) if m.split(".")[0] == "tf_memsafe")
              for name, path in MODULES.items()}
    assert {name: m for name, m in upward.items() if m} == {}


def test_no_import_cycle_among_grappler_ext_modules():
    """A package's ``__init__`` re-exporting its own submodules is not an arrow back into them."""
    def arrows(name, path):
        out = {m for m in imports(path) if m in MODULES} - {name}
        return {m for m in out if not m.startswith(name + ".")} if path.name == "__init__.py" else out

    graph = {name: arrows(name, path) for name, path in MODULES.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name):
        state[name] = 1
        stack.append(name)
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_module_sizes():
    lines = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in MODULES.items()}
    over = {name: n for name, n in lines.items() if n > MAX_LINES and name not in RULE_TABLES}
    assert over == {}
    assert lines["grappler_ext.splitter.driver"] <= MAX_DRIVER_LINES


def test_the_imports_are_read():
    """The reader sees the arrows it is meant to (so the tests above can fail)."""
    assert "grappler_ext.splitter.rules" in imports(MODULES["grappler_ext.splitter.mechanism"])
    assert "grappler_ext.graph_query" in imports(MODULES["grappler_ext.splitter.driver"])
