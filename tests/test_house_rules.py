"""House rules of src/ (issue 11, point 6), checked on the source text so they cannot rot.

ruff and mypy run in CI (``.ci/run``); the rules below are the ones no linter states: file
size, production code independent of the test helpers, a docstring on every public
definition (also where ruff is not run), and the PEP 561 marker.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "lowcomm"
MAX_LINES = 400
#: the test helpers may import themselves; nothing else in src/ may import them
TESTING = SRC / "testing"


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(SRC.parent))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_sources_are_found() -> None:
    assert len(_sources()) > 20 and (SRC / "__init__.py").exists()


def test_no_source_file_is_longer_than_the_limit() -> None:
    long = {_rel(p): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by job): {long}"


def _imports_testing(tree: ast.Module) -> list[int]:
    """Lines that import lowcomm.testing (``import``, ``from ... import``, or
    ``from lowcomm import testing``), anywhere in the module, functions included."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(a.name == "lowcomm.testing" or a.name.startswith("lowcomm.testing.") for a in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "lowcomm.testing" or node.module.startswith("lowcomm.testing."):
                lines.append(node.lineno)
            elif node.module == "lowcomm" and any(a.name == "testing" for a in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("lowcomm.testing"):
                lines.append(node.lineno)
    return lines


def test_the_import_check_sees_every_spelling() -> None:
    code = (
        "import lowcomm.testing\nfrom lowcomm.testing.distributed import free_port\n"
        "from lowcomm import testing\ndef f():\n    import importlib\n"
        "    importlib.import_module('lowcomm.testing')\nimport lowcomm.testingx\n"
    )
    assert _imports_testing(ast.parse(code)) == [1, 2, 3, 6]


def test_production_code_does_not_import_the_test_helpers() -> None:
    offenders = {
        _rel(p): lines
        for p in _sources()
        if TESTING not in p.parents and (lines := _imports_testing(_tree(p)))
    }
    assert not offenders, f"production code imports lowcomm.testing (file: lines): {offenders}"


def _is_public(name: str) -> bool:
    return not name.startswith("_")


def _exported(tree: ast.Module) -> set[str] | None:
    """The names of a literal ``__all__`` (None without one): with it, as for ruff, only those
    top-level names are public."""
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            try:
                return set(ast.literal_eval(node.value))  # type: ignore[union-attr]
            except ValueError:
                return None
    return None


def _undocumented(tree: ast.Module) -> list[str]:
    """Public classes, functions and methods (dunders excluded) without a docstring, with the
    module itself; nested functions and members of private classes are not public."""
    missing = [] if ast.get_docstring(tree) else ["<module>"]
    exported = _exported(tree)

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not _is_public(node.name) or (not prefix and exported is not None and node.name not in exported):
                    continue
                if ast.get_docstring(node) is None and not _is_overload(node):
                    missing.append(f"{prefix}{node.name}:{node.lineno}")
                if isinstance(node, ast.ClassDef):
                    visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    return missing


def _is_overload(node: ast.stmt) -> bool:
    """``@overload`` stubs and property setters share the documented definition's docstring."""
    for dec in getattr(node, "decorator_list", []):
        name = dec.attr if isinstance(dec, ast.Attribute) else getattr(dec, "id", "")
        if name in ("overload", "setter", "deleter"):
            return True
    return False


def test_the_docstring_check_finds_what_it_should() -> None:
    code = (
        '"""Module."""\nclass A:\n    """Doc."""\n    def f(self): pass\n    def _g(self): pass\n'
        "    def __len__(self): return 0\n"
        "class _P:\n    def f(self): pass\ndef h():\n    def inner(): pass\n"
    )
    assert _undocumented(ast.parse(code)) == ["A.f:4", "h:9"]
    # with __all__, top-level names outside it are not public (ruff's rule too)
    assert _undocumented(ast.parse('"""M."""\n__all__ = ["g"]\ndef f(): pass\ndef g(): pass\n')) == ["g:4"]


def test_every_public_definition_has_a_docstring() -> None:
    missing = {_rel(p): m for p in _sources() if (m := _undocumented(_tree(p)))}
    count = sum(len(m) for m in missing.values())
    assert not missing, f"{count} public definitions without a docstring (file: name:line): {missing}"


def test_package_is_marked_as_typed() -> None:
    assert (SRC / "py.typed").is_file()
    pyproject = (SRC.parents[1] / "pyproject.toml").read_text()
    assert 'lowcomm = ["py.typed"]' in pyproject  # shipped in the wheel (package-data)


@pytest.mark.parametrize("tool", ["ruff", "mypy"])
def test_ci_runs_the_linters_over_src(tool: str) -> None:
    ci = (SRC.parents[1] / ".ci" / "run").read_text()
    pyproject = (SRC.parents[1] / "pyproject.toml").read_text()
    assert f".venv/bin/{tool}" in ci and "make test" in ci
    dev = next(line for line in pyproject.splitlines() if line.startswith("dev = "))
    assert f'"{tool}' in dev
