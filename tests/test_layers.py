"""autofit's layers hold: no module imports from a layer above its own (import-linter's
contract in .importlinter), no two modules import each other however indirectly (imports
inside functions counted), imports inside functions only where they defer torch or optuna,
and the CLI starts without torch or optuna.

    python -m pytest tests/test_layers.py -q
"""

import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "autofit"
# The only places an autofit module is imported inside a function (or by name through
# importlib): the lazy package __init__ and the CLI's dispatch, both to defer torch/optuna.
# The package and the CLI defer torch and optuna to the command that needs them. Two more defer
# torch so that the tune's parent never imports it (its trial worker does): a profile's
# `apply` (profiles read and written there) and the search space's in-process analysis
# (tests and tools; the tune's worker sends its own).
DEFERRING_MODULES = {"autofit", "autofit.cli", "autofit.profiles.profile", "autofit.tuning.space"}
MAX_DEFERRED_IMPORTS = 20


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """Every autofit import of one module: (target, line, inside a function)."""

    def __init__(self, module: str, is_package: bool, known: set[str]):
        self.module, self.is_package, self.known = module, is_package, known
        self.found: list[tuple[str, int, bool]] = []
        self.depth = 0

    def visit_If(self, node: ast.If):
        if _type_checking(node):  # annotations only: never executed
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _add(self, target: str, line: int):
        while target not in self.known and "." in target:
            target = target.rsplit(".", 1)[0]
        if target.split(".")[0] == "autofit" and target != self.module:
            self.found.append((target, line, self.depth > 0))

    def visit_Import(self, node: ast.Import):
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = self.module.split(".")
            keep = len(parts) - node.level + (1 if self.is_package else 0)
            base = ".".join(parts[:keep] + ([node.module] if node.module else []))
        for alias in node.names:
            full = f"{base}.{alias.name}"
            self._add(full if full in self.known else base, node.lineno)

    def visit_Call(self, node: ast.Call):
        # importlib.import_module of an autofit module: by its name, or through a table of
        # them (a subscript). A user's module imported by a name from their spec is not ours.
        func, args = node.func, node.args
        if isinstance(func, ast.Attribute) and func.attr == "import_module" and args and (
                isinstance(args[0], ast.Subscript) or (isinstance(args[0], ast.Constant)
                                                       and str(args[0].value).startswith("autofit"))):
            self.found.append(("<importlib>", node.lineno, True))
        self.generic_visit(node)


def import_graph(root: Path) -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """(module -> the autofit modules it imports, [(module, target, line) of imports in functions])."""
    modules = _modules(root)
    known = set(modules)
    graph, deferred = {}, []
    for name, path in modules.items():
        visitor = _Imports(name, path.name == "__init__.py", known)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        graph[name] = {t for t, _, _ in visitor.found if t != "<importlib>"}
        deferred += [(name, t, line) for t, line, inside in visitor.found if inside]
    return graph, deferred


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_another_that_imports_it_back():
    graph, _ = import_graph(PACKAGE)
    assert cycles(graph) == []


def test_no_autofit_import_hides_under_type_checking():
    # An import only the type checker sees is still a dependency the cycle check above skips:
    # a module that needs another's type for an annotation names a Protocol of what it reads.
    hidden = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.If) and _type_checking(node):
                hidden += [f"{path.relative_to(REPO)}:{child.lineno}" for child in ast.walk(node)
                           if isinstance(child, ast.ImportFrom) and (child.module or "").startswith("autofit")]
    assert hidden == []


def test_imports_inside_functions_only_defer_torch_or_optuna_in_the_cli_and_the_package():
    _, deferred = import_graph(PACKAGE)
    assert [d for d in deferred if d[0] not in DEFERRING_MODULES] == []
    assert len(deferred) <= MAX_DEFERRED_IMPORTS, deferred


def test_the_checks_find_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "autofit"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from autofit.low import b\n")
    (pkg / "low" / "b.py").write_text("def f():\n    from autofit.low import a\n")
    graph, deferred = import_graph(pkg)
    assert cycles(graph) == [["autofit.low.a", "autofit.low.b"]]
    assert deferred == [("autofit.low.b", "autofit.low.a", 2)]


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    pytest.importorskip("importlinter", reason="import-linter is a dev dependency: pip install -e '.[dev]'")
    shutil.copy(REPO / ".importlinter", root / ".importlinter")
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint)], cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_the_layers_contract_holds(tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "autofit", ignore=shutil.ignore_patterns("__pycache__"))
    result = _lint_imports(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 kept, 0 broken" in result.stdout


def test_the_layers_contract_fails_on_an_upward_import(tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "autofit", ignore=shutil.ignore_patterns("__pycache__"))
    sizes = tmp_path / "autofit" / "base" / "sizes.py"
    sizes.write_text(sizes.read_text() + textwrap.dedent("""

        def _upward():
            from autofit.tuning.tune import tune  # base importing the tune pipeline: two floors up
            return tune
    """))
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "autofit.base.sizes -> autofit.tuning.tune" in result.stdout


def _heavy_modules_after(code: str) -> list[str]:
    """Which of torch, optuna and numpy a fresh interpreter holds after running `code`."""
    result = subprocess.run([sys.executable, "-c", f"import sys; {code}; "
                             "print(','.join(m for m in ('torch', 'optuna', 'numpy') if m in sys.modules))"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [m for m in result.stdout.strip().split(",") if m]


def test_the_cli_starts_without_torch_or_optuna():
    assert _heavy_modules_after("import autofit, autofit.cli; autofit.cli.build_parser()") == []


def test_the_tunes_parent_imports_no_torch():
    # Its trial worker imports torch while the parent opens the study: on a small host the two
    # imports would cost an answer's first seconds twice (issue 33: SIGTERM at 10 s).
    assert "torch" not in _heavy_modules_after("import autofit.commands.tune, autofit.tuning.tune, autofit.service.job")


def test_the_public_api_is_lazy_and_complete():
    import autofit

    assert "load_profile" in autofit.__all__ and "__version__" in autofit.__all__
    for name in autofit.__all__:
        assert getattr(autofit, name) is not None, name
    with pytest.raises(AttributeError):
        autofit.no_such_name  # noqa: B018
