"""The repository's shape, checked: functions and modules of a readable size, no import cycle, the dependency
rule between the packages, and a repository that speaks of the product, not of how it was made."""
import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "fastppl"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 450


def _modules() -> dict[str, Path]:
    """{dotted name: path} of every module of the package."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, at any depth of its code (lazy imports too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found.update(c for c in candidates if c in modules and c != name)
    return found


def test_functions_and_modules_are_of_a_readable_size():
    long_functions, long_modules = [], []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines: {long_modules}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def _package_of(module: str) -> str:
    """The first level below fastppl: 'data', 'engine', ... or the top-level module's own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fastppl"


def test_no_import_cycle_between_modules():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # a package's __init__ is imported on the way to each of its modules; it is no edge of the design
    graph = {name: {t for t in targets if not name.startswith(t + ".")} for name, targets in graph.items()}
    state, cycles = {}, []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [node, target]))
            elif target not in state:
                visit(target, stack + [node])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not cycles, f"import cycles: {cycles}"


def test_the_dependency_rule_between_packages():
    """engine/ uses models/ and data/ only (and the errors and config every layer shares); models/ and data/ use
    nothing above them; nothing but the CLI imports cli/ or bench/."""
    allowed = {"engine": {"engine", "models", "data", "errors", "config"},
               "models": {"models", "errors", "config", "quiet"},
               "data": {"data", "errors", "config", "quiet"}}
    modules = _modules()
    broken = []
    for name, path in modules.items():
        source = _package_of(name)
        for target in _imports(name, path, modules):
            used = _package_of(target)
            if source in allowed and used not in allowed[source] and target != "fastppl":
                broken.append(f"{name} imports {target}")
            if used in ("cli", "bench") and source not in ("cli", used) and name != "fastppl.__main__":
                broken.append(f"{name} imports {target}")
    assert not broken, broken


# [c]: not a hit itself
HISTORY = re.compile(r"session [0-9]|issue [0-9]|the issue'?s\b|dev[c]ache|\$OUT", re.IGNORECASE)


def test_the_repository_speaks_of_the_product_not_of_its_history():
    """No history entries, work-item numbers or scratch paths in code, comments, docs or tracked scripts."""
    try:
        tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        paths = [ROOT / p for p in tracked.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    this_test = Path(__file__).resolve()
    hits = []
    for path in paths:
        if path.resolve() == this_test or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue   # binary (a picture)
        hits += [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:80]}"
                 for n, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]
    assert not hits, hits[:20]


FAMILY_FILES = {"src/fastppl/models/gpt2.py", "src/fastppl/models/llama.py", "src/fastppl/models/qwen3.py"}


def test_only_a_family_asks_whether_a_model_is_of_its_class():
    """What a family is and offers lives in its ModelSpec (fastppl.models.registry); the rest of the package asks
    the spec, never `isinstance(model, Llama)`."""
    pattern = re.compile(r"isinstance\([^)]*(Llama|GPT2|Qwen)")
    hits = [f"{path.relative_to(ROOT)}:{n}" for path in PACKAGE.rglob("*.py")
            if str(path.relative_to(ROOT)) not in FAMILY_FILES
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits
