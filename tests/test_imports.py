"""The project's import graph, read from the source (every import, at the top of a file or inside a function):
no circle among the modules, no installed module that imports or reads tests/ (a wheel leaves tests/ out),
bench/ never imports the command layer (commands/ runs bench/, not the other way round), and bench/ holds only
what a `bench` subcommand runs, each module importing cleanly."""
from __future__ import annotations

import ast
import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def installed_packages() -> list[str]:
    """The top-level packages pyproject.toml installs."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()
                  and any(fnmatch.fnmatch(p.name, pattern) for pattern in find["include"]))


def module_files() -> dict[str, Path]:
    """Installed module name -> its file: every .py of the installed packages, and cli.py."""
    files = {"cli": ROOT / "cli.py"}
    for package in installed_packages():
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def runtime_nodes(tree: ast.AST):
    """ast.walk, less the bodies of `if TYPE_CHECKING:` (imports for annotations only, never executed)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def imported_names(path: Path, module: str) -> set[str]:
    return imported_names_in(ast.parse(path.read_text(), str(path)), module, path)


def imported_names_in(tree: ast.AST, module: str, path: Path) -> set[str]:
    """Every dotted name a module imports when it runs (relative imports resolved; `from a import b` gives
    a.b, and the caller keeps the longest part that is a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in runtime_nodes(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (a name's longest prefix that is a module)."""
    graph = {}
    for module, path in files.items():
        targets = set()
        for name in imported_names(path, module):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_circle_and_only_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    graph = import_graph(module_files())
    assert len(graph) > 100 and graph["commands.bench"]       # the whole tree was read
    assert cycles(graph) == []


def references_to_tests(source: str, module: str, path: Path) -> list[str]:
    """Where `source` imports tests/ or names a path in it (a string other than a docstring)."""
    tree = ast.parse(source, str(path))
    found = [f"{module} imports tests" for name in imported_names_in(tree, module, path)
             if name.split(".")[0] in ("tests", "conftest")]
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return found + [f"{module} line {node.lineno}: {node.value[:60]!r}" for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docstrings and (node.value == "tests" or "tests/" in node.value)]


def test_a_read_of_tests_is_found_and_a_docstring_is_not():
    source = ('"""Checked by tests/test_x.py."""\nimport conftest\nif TYPE_CHECKING:\n    import tests.trees\n'
              'CONFIG = ROOT / "tests/fixtures/configs/llama-2-70b"\n')
    assert references_to_tests(source, "bench.x", Path("bench/x.py")) == [
        "bench.x imports tests", "bench.x line 5: 'tests/fixtures/configs/llama-2-70b'"]


def test_no_installed_module_imports_or_reads_tests():
    assert [hit for module, path in module_files().items()
            for hit in references_to_tests(path.read_text(), module, path)] == []


def test_bench_never_imports_the_command_layer():
    graph = import_graph(module_files())
    assert {m: sorted(t for t in targets if t == "cli" or t.split(".")[0] == "commands")
            for m, targets in graph.items() if m.split(".")[0] == "bench"} == {
        m: [] for m in graph if m.split(".")[0] == "bench"}


def started_children(path: Path) -> set[str]:
    """The bench/ modules a module starts in a process of its own: a string constant naming one as `-m bench.X`'s
    argument, or as its file (bench/X.py, X.py)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.removeprefix("bench/").removesuffix(".py").removeprefix("bench.")
            if text.isidentifier() and (ROOT / "bench" / f"{text}.py").is_file():
                names.add(f"bench.{text}")
    return names


def test_bench_holds_only_what_the_command_layer_runs():
    """Every bench/ module is imported by a `bench` subcommand's code, or started as a child process by it."""
    files = module_files()
    graph = import_graph(files)
    reached, todo = set(), [m for m in graph if m.split(".")[0] == "commands"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += [*graph[module], *started_children(files[module])]
    assert sorted(m for m in graph if m.startswith("bench.") and m not in reached) == []


def test_every_bench_module_finds_what_it_imports_from_the_project():
    """A name moved out of a module breaks a bench the suite never runs (bench/ggml_products.py once imported F32
    from where it had left); a peer's own package missing here (AirLLM, llama-cpp-python) is no fault."""
    import importlib
    import sys
    project = {name.split(".")[0] for name in module_files()}
    broken = {}
    for module in sorted(m for m in module_files() if m.startswith("bench.")):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name and error.name.split(".")[0] in project:
                broken[module] = str(error)
        except ImportError as error:
            broken[module] = str(error)
    assert broken == {} and "bench.products_bench" in sys.modules
