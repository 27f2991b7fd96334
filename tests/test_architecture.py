"""The package's shape: each module imports only modules below it in the pipeline order, none is
too long to read in one sitting, and the manager and CLI reach a checkpoint root only through
``zerostall.roots.root`` (so an object-store backend serves them unchanged)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "zerostall"

# Low to high, floor by floor: a module may import only modules before it, and each folder's modules
# stand together, so a folder imports only from itself and the floors below. A new module must be placed here.
ORDER = [
    # shared basics that import nothing above them
    "errors", "memory", "devices", "gcpause", "balance",
    # format/: the on-disk contract, no I/O
    "format.codec", "format.dicts", "format.checksums", "format.boxes", "format.layout", "format.envelope", "format.safetensors_file", "format.subclass", "format.flattened",
    "format.tensor_check", "format.value_check", "format.head_check", "format.manifest_check", "format.retained", "format",
    # storage/: one backend a module; a checkpoint's location (what may be written, the commit step)
    "storage.base", "storage.vectored", "storage.local", "storage.s3client", "storage.s3reads", "storage.s3", "storage", "storage.location",
    "storage.references",
    # shared basics over storage: the process group, the state tree, the options
    "doorbell", "collectives", "views", "state", "options",
    # saving/: collect → plan → write → commit, run in order by pipeline; the asynchronous saver over it
    "saving.collect", "saving.plan", "saving.recollect", "saving.write", "saving.incremental", "saving.commit",
    "saving.pipeline", "saving.estimate",
    "saving.capture", "saving.handles", "saving.writer_process", "saving.asynchronous", "saving",
    # loading/: open (ours or foreign) → reader (bytes, checked) → load plan → fetch (and broadcast) →
    # verification, behind the Checkpoint front; tensor streams for exporters
    "loading.foreign.safetensors", "loading.foreign.dcp", "loading.foreign", "loading.opening", "loading.reader",
    "loading.optimizers", "loading.load_plan", "loading.fetch", "loading.broadcast", "loading.verification",
    "loading.trees", "loading.checkpoint", "loading.tensor_stream", "loading",
    # roots/: checkpoints by step under a root
    "roots.retention", "roots.sharing", "roots.stale", "roots.resaving", "roots.described", "roots.root", "roots.forking", "roots.naming", "roots.restore", "roots.schedule", "roots.lease",
    "roots.loaders", "roots.increments", "roots",
    # interop/: checkpoints leaving zerostall
    "interop.contained", "interop.copying", "interop.torch_file", "interop.export_files", "interop.exporting", "interop",
    # the public functions, then the manager over them
    "api",
    # tiers/: the node-local tier, node identity, copies between nodes, restore from the fastest copy
    "tiers.nodes", "tiers.timelines", "tiers.local", "tiers.stream", "tiers.placing", "tiers.transfer", "tiers.copies", "tiers.replication", "tiers.sources",
    "tiers.tier", "tiers",
    "manager",
    # integrations/: adapters for the frameworks users train with, over the public API
    "integrations.deepspeed.values", "integrations.deepspeed.space", "integrations.deepspeed.swap", "integrations.deepspeed.tags", "integrations.deepspeed.engine",
    "integrations.deepspeed.consolidate", "integrations.deepspeed.attach", "integrations.deepspeed",
    "integrations.lightning.values", "integrations.lightning.staging", "integrations.lightning.checkpoint_io",
    "integrations.lightning.model_parallel", "integrations.lightning",
    "integrations.torchtitan.hf", "integrations.torchtitan.manager", "integrations.torchtitan", "integrations",
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


def test_each_folder_stands_together_in_the_order():
    """With the module rule, this makes the folder rule: a folder imports only from folders below it."""
    folders = [name.split(".")[0] if "." in name or (PACKAGE / name).is_dir() else name for name in ORDER]
    runs = [f for i, f in enumerate(folders) if i == 0 or folders[i - 1] != f]
    assert len(runs) == len(set(runs)), f"a folder's modules are split in ORDER: {runs}"


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
