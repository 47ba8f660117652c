"""The shape of the package, checked from its source with `ast`: no import cycles, dependencies pointing one way,
and files and functions a reader can hold in their head."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dspark"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
# the torch-free runtime never reaches into the export side, the GPU backend or torch
RUNTIME_MUST_NOT_IMPORT = ("dspark.trt", "dspark.models", "dspark.export", "dspark.train", "dspark.calibration",
                           "torch", "transformers", "onnx", "tensorrt", "tensorrt_rtx", "cuda")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """dspark modules (and external top-level packages) that `path` imports anywhere in its body."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    graph = {}
    for name, path in mods.items():
        targets = set()
        for imp in imports_of(path, name, known):
            # `import dspark.a.b` needs dspark.a.b; a parent package's __init__ is not an edge we police
            if imp in known and imp != name and not name.startswith(imp + "."):
                targets.add(imp)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_runtime_imports_only_its_own_side():
    mods = modules()
    for name, path in mods.items():
        if not name.startswith("dspark.runtime"):
            continue
        bad = sorted(i for i in imports_of(path, name, set(mods))
                     if any(i == p or i.startswith(p + ".") for p in RUNTIME_MUST_NOT_IMPORT))
        assert not bad, f"{name} imports {bad}"


def test_trt_reaches_the_runtime_only_through_its_interface():
    mods = modules()
    allowed = {"dspark.runtime", "dspark.runtime.backend"}
    for name, path in mods.items():
        if name.startswith("dspark.trt"):
            used = {i for i in imports_of(path, name, set(mods)) if i.startswith("dspark.runtime")}
            assert used <= allowed, f"{name} imports {sorted(used - allowed)}"


def test_files_and_functions_are_short():
    long_files, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(PACKAGE)} ({len(text.splitlines())})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({length})")
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"
