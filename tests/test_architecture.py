"""The package's shape: each module imports only modules below it in the pipeline order, none is
too long to read in one sitting, and the manager and CLI reach a checkpoint root only through
``zerostall.root`` (so an object-store backend serves them unchanged)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "zerostall"

# Low to high: a module may import only modules before it. A new module must be placed here.
ORDER = [
    "errors", "memory", "devices", "gcpause", "codec", "checksums", "balance", "boxes", "format", "subclass",
    "tensor_check", "value_check", "manifest_check",
    "storage.base", "storage.local", "storage.s3client", "storage.s3reads", "storage.s3", "storage", "doorbell",
    "collectives", "state", "options", "sources.safetensors", "sources.dcp", "sources", "opening", "location",
    # saving: collect → plan → write → commit, run in order by saving
    "collect", "plan", "write", "commit", "saving",
    # reading: opening → reader (bytes, checked) → load plan → fetch (and broadcast) → verification,
    # behind the Checkpoint front
    "reader", "sources.optimizers", "load_plan", "fetch", "broadcast", "verification", "checkpoint",
    # asynchronous saving; checkpoints by step under a root; then the public functions
    "capture", "writer_process", "asynchronous", "retention", "root", "copying", "tensor_stream", "torch_file", "exporting", "api",
    "schedule", "lease", "manager",
    "cli.common", "cli.listing", "cli.inspecting", "cli.comparing", "cli.copying", "cli.exporting", "cli.importing",
    "cli", "__main__", "__init__",
]
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file (lazy imports included)."""
    package = [] if name == "__init__" else name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + (node.module.split(".") if node.module else []))
            elif node.module and node.module.split(".")[0] == "zerostall":
                target = node.module.removeprefix("zerostall").lstrip(".")
            else:
                continue
            known = modules()
            for alias in node.names:  # `from . import codec` imports a module
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "zerostall":
                    found.add(alias.name.removeprefix("zerostall").lstrip("."))
    found.discard(name)
    return {f if f else "__init__" for f in found}


def test_every_module_has_a_place_in_the_order():
    assert sorted(modules()) == sorted(ORDER), "place new modules in ORDER (and remove deleted ones)"


def test_modules_import_only_modules_below_them():
    upward = []
    for name, path in modules().items():
        for target in imported(name, path):
            if name.split(".")[0] == "cli" and target == "__init__":
                continue  # the CLI uses the public API, the top of the package
            if ORDER.index(target) >= ORDER.index(name):
                upward.append(f"{name} imports {target}")
    assert not upward, upward


def test_no_module_is_too_long_to_read():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules by job: {long}"


def test_the_manager_and_the_cli_reach_a_root_only_through_storage():
    """No file-system call of their own (os, shutil, pathlib, open): an object-store root must work."""
    calls = []
    for name in ("manager", "cli.common", "cli.listing", "cli.inspecting", "cli.comparing", "cli"):
        path = modules()[name]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                calls += [f"{name} imports {n}" for n in names if n.split(".")[0] in ("shutil", "pathlib", "glob")]
            if isinstance(node, ast.Call):
                func = node.func
                while isinstance(func, ast.Attribute):
                    func = func.value
                if isinstance(func, ast.Name) and func.id in ("os", "shutil", "open", "Path"):
                    calls.append(f"{name}:{node.lineno} calls {ast.unparse(node.func)}")
    assert not calls, calls
