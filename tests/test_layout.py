"""Tests mirror the library: tests/<package>/test_<module>.py is about lib/eaglekit/<package>/<module>.py,
tests/<package>/test_<package>.py about the package itself, and tests/test_<module>.py about a top-level
module. A renamed module leaves no test named after a module that is gone. Whole-pipeline tests live in
tests/e2e/."""

import ast
from pathlib import Path

TESTS = Path(__file__).parent
LIBRARY = TESTS.parent / "lib" / "eaglekit"
# Tests of a behaviour across modules rather than of one module, by folder.
TOPICS = {
    ".": {"layout": "this file", "notebooks": "committed notebooks: stripped, parameters cell, thin"},
    "e2e": {
        "chaos": "stage 03 under kill -9 of runner, kernel and endpoint",
        "pipeline": "the six notebooks through the runner on params/smoke.yaml",
        "targets": (
            "tiny Llama, DeepSeek-V3 and Kimi-K2.5-shaped targets through capture, training, export, evaluate"
        ),
        "vllm_eagle3": (
            "a real vLLM serving the kit's export with EAGLE-3: its tau against the kit's loop and offline"
        ),
    },
    "chat": {
        "templates": "published chat templates through eaglekit.chat",
        "published_quirks": "the quirks of newly vendored published templates, each once refused or wrong",
    },
    "generation": {
        "protocol": "the client against SGLang's and vLLM's own response models",
        "vllm": "generation against a real vLLM (its CPU build)",
    },
    "draft": {
        "target_families": "head loading, shapes and exports on every tiny target family",
        "speculators_load": "the vLLM export through speculators' own loader and forward",
        "doctor_serving": "the doctor on server settings SGLang and vLLM refuse with a kit draft",
    },
    "training": {
        "recipe_levers": "distillation target and feature noise through training",
        "faults": "NaN features, torn checkpoints and dead writers' temp files through training and export",
    },
}
MAX_FUNCTION_LINES = 80  # lines of a function, its docstring not counted


def _subject_exists(folder: Path, name: str) -> bool:
    relative = folder.relative_to(TESTS)
    package = LIBRARY / relative
    if name in TOPICS.get(str(relative), {}):
        return True
    if (package / f"{name}.py").is_file():
        return True
    return name == relative.name and (package / "__init__.py").is_file()


def test_every_test_file_is_named_after_a_module_or_a_topic():
    stale = [
        str(path.relative_to(TESTS))
        for path in sorted(TESTS.rglob("test_*.py"))
        if "fixtures" not in path.parts and not _subject_exists(path.parent, path.stem.removeprefix("test_"))
    ]
    assert not stale, (
        f"tests {stale} are named after no module under {LIBRARY}: `git mv` them to "
        "tests/<package>/test_<module>.py after the module they test, or name the topic in TOPICS"
    )


def test_every_test_folder_is_a_package_of_the_library_or_e2e():
    folders = sorted(
        path.name
        for path in TESTS.iterdir()
        if path.is_dir() and path.name not in {"fixtures", "__pycache__"}
    )
    stray = [name for name in folders if name != "e2e" and not (LIBRARY / name / "__init__.py").is_file()]
    assert not stray, f"test folders {stray} mirror no package under {LIBRARY}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(LIBRARY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, deferred: bool) -> set[str]:
    """eaglekit modules `path` imports at module level, or (deferred) inside its functions, resolved to
    modules that exist. A deferred import is a dependency all the same: deferring it only hides a circle."""
    tree = ast.parse(path.read_text())
    nodes = [node for node in ast.walk(tree) if node not in tree.body] if deferred else tree.body
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eaglekit"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                names.add(candidate if _exists(candidate) else node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("eaglekit"))
    return {name for name in names if _exists(name)}


def _exists(module: str) -> bool:
    path = LIBRARY.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_the_library_has_no_import_circle():
    graph = {_module_name(path): _imports(path, deferred=False) for path in LIBRARY.rglob("*.py")}
    # A module importing a package's submodule also runs the package's __init__, except its own packages'
    # (already running when the module is imported, so that edge is no circle).
    for module, imports in graph.items():
        for name in list(imports):
            parts = name.split(".")
            imports.update(
                package
                for i in range(2, len(parts))
                if (package := ".".join(parts[:i])) in graph and not module.startswith(package + ".")
            )
        imports.discard(module)
    # Imports inside functions run once every module is loaded: a module-to-module edge, packages aside.
    for path in LIBRARY.rglob("*.py"):
        graph[_module_name(path)].update(_imports(path, deferred=True) - {_module_name(path)})
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(module: str, stack: list[str]) -> bool:
        state[module] = 1
        for name in sorted(graph.get(module, ())):
            if state.get(name) == 1:
                cycle.extend(stack[stack.index(name) :] + [module, name] if name in stack else [module, name])
                return True
            if state.get(name) is None and visit(name, stack + [module]):
                return True
        state[module] = 2
        return False

    for module in sorted(graph):
        if state.get(module) is None and visit(module, []):
            break
    assert not cycle, f"import circle: {' -> '.join(cycle)}"


def _function_lengths(path: Path) -> dict[str, int]:
    """{qualified name: lines from its `def` to its end, less its docstring} of every function in `path`."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = child.end_lineno - child.lineno + 1
                first = child.body[0]
                if (
                    isinstance(first, ast.Expr)
                    and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)
                ):
                    lines -= first.end_lineno - first.lineno + 1
                lengths[f"{prefix}{child.name}"] = lines
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return lengths


def test_no_function_is_over_the_line_budget():
    """A function reads on one screen: at most MAX_FUNCTION_LINES lines, its docstring not counted."""
    long = {
        f"{path.relative_to(LIBRARY)}:{name}": lines
        for path in sorted(LIBRARY.rglob("*.py"))
        for name, lines in _function_lengths(path).items()
        if lines > MAX_FUNCTION_LINES
    }
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them along their steps): {long}"


def test_the_function_budget_sees_a_long_function(tmp_path):
    source = tmp_path / "long.py"
    source.write_text(
        'def short():\n    """Doc\n    string."""\n    return 1\n\n\nclass Holder:\n    def long(self):\n'
        + "".join(f"        x{line} = {line}\n" for line in range(MAX_FUNCTION_LINES))
    )
    assert _function_lengths(source) == {"short": 2, "Holder.long": MAX_FUNCTION_LINES + 1}


def test_the_readme_layout_names_every_package_and_module_of_the_library():
    """README's Layout section lists `lib/eaglekit/`'s packages (`name/`) and top-level modules (`name`): a
    new one is described there, a removed one leaves no stale entry."""
    readme = (TESTS.parent / "README.md").read_text()
    layout = readme[readme.index("## Layout") : readme.index("## Tests and benchmarks")]
    listed = {line.split("`")[1] for line in layout.splitlines() if line.startswith("- `")}
    tree = {f"{path.name}/" for path in LIBRARY.iterdir() if (path / "__init__.py").is_file()}
    tree |= {path.stem for path in LIBRARY.glob("*.py") if not path.name.startswith("__")}
    assert listed == tree, (
        f"in the tree, not the README: {sorted(tree - listed)}; "
        f"in the README, not the tree: {sorted(listed - tree)}"
    )
