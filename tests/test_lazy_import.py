"""Start-up: the ``zerostall`` command never imports torch, and ``import zerostall`` loads the public
names on first use, each the same object as before."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import zerostall as zs
from zerostall.cli import cli

# Runs the command line as the console script does, then says which torch modules were imported.
RUN_CLI = """
import sys
from zerostall.cli import main
try:
    main()
    code = 0
except SystemExit as exc:
    code = exc.code
print("torch modules imported:", sorted(m for m in sys.modules if m.split(".")[0] == "torch"), file=sys.stderr)
sys.exit(code)
"""


def run_cli(*args: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-c", RUN_CLI, *map(str, args)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.stderr.endswith("torch modules imported: []\n"), done.stderr
    return done


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A CheckpointManager root (steps 10 and 20, with RNG states and a loss) and a plain checkpoint
    in it, with a tied tensor, bfloat16 and python values."""
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    mgr = zs.CheckpointManager(tmp_path, fsync=False)
    try:
        for step in (10, 20):
            model = {"weight": weight * step, "tied": weight, "bias": torch.zeros(4, dtype=torch.bfloat16)}
            mgr.save(step, {"model": model, "step": step, "sched": {"betas": (0.9, 0.999)}}, metrics={"loss": 1 / step})
    finally:
        mgr.close()
    zs.save({"w": weight, "tied": weight, "lr": 0.1, "note": b"\x00"}, tmp_path / "plain", step=1)
    return tmp_path


@pytest.mark.parametrize("args", [
    ["--help"], ["--version"], ["ls", "{root}"], ["ls", "{root}", "--keep-last", "1", "--json"],
    ["prune", "{root}", "--keep-last", "1", "--dry-run"], ["prune", "{root}", "--keep-last", "1", "--json"],
    ["inspect", "{root}/plain"], ["inspect", "{root}/step_000000010", "--json"], ["inspect", "{root}/latest"],
    ["verify", "{root}/plain"], ["verify", "{root}", "--json"], ["verify", "{root}/10"], ["import", "--help"],
], ids=" ".join)
def test_commands_never_import_torch(root: Path, args: list[str]) -> None:
    done = run_cli(*(a.format(root=root) for a in args))
    assert done.returncode == 0, done.stderr
    if "--json" in args:
        json.loads(done.stdout)
    elif args[0] == "inspect":
        assert "float32" in done.stdout and "tied" in done.stdout
    elif args[0] == "verify":
        assert done.stdout.startswith("OK ")


def test_failing_commands_never_import_torch(root: Path) -> None:
    (root / "plain" / "manifest.json").write_bytes(b"{}")
    assert run_cli("inspect", root / "plain").returncode == 1
    assert run_cli("verify", root / "plain", "--json").returncode == 1
    assert run_cli("verify", root / "missing").returncode == 2
    assert run_cli("ls", root / "missing").returncode == 2


def test_python_m_zerostall_never_imports_torch(root: Path) -> None:
    for args in (["--help"], ["ls", root]):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "zerostall", *map(str, args)],
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        lines = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
        imported = {line.rsplit("|", 1)[-1].strip() for line in lines}
        assert "zerostall.cli" in imported and not {m for m in imported if m.split(".")[0] == "torch"}


def test_a_torch_value_is_still_shown(tmp_path: Path) -> None:
    """A python value that is a torch dtype, size or device needs torch to decode: imported then."""
    zs.save({"dtype": torch.float16, "shape": torch.Size([2, 3]), "w": torch.ones(2)}, tmp_path / "ck")
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path / "ck"), "--json"])
    assert result.exit_code == 0, result.output
    values = {e["fqn"]: e.get("value") for e in json.loads(result.stdout)["entries"]}
    assert values["dtype"] == "torch.float16" and values["shape"] == "torch.Size([2, 3])"
    assert CliRunner().invoke(cli, ["verify", str(tmp_path / "ck")]).exit_code == 0


def test_the_public_api_after_a_plain_import(tmp_path: Path) -> None:
    """In a fresh process: ``import zerostall`` imports no torch; then every public name works and is
    the object its module defines, also after the command line's modules were imported."""
    script = f"""
import sys
import zerostall as zs
assert "torch" not in sys.modules
import zerostall.cli, zerostall.loading.verification  # the module behind verify() must not shadow it
assert "torch" not in sys.modules
import torch
path = {str(tmp_path / "ck")!r}
state = {{"w": torch.arange(6.0).reshape(2, 3), "n": 3, "dtype": torch.bfloat16}}
info = zs.save(state, path, zs.SaveOptions(fsync=False), step=7)
assert isinstance(info, zs.SaveInfo)
out = zs.load({{"w": torch.zeros(2, 3), "n": 0, "dtype": None}}, path)
assert torch.equal(out["w"], state["w"]) and out["n"] == 3 and out["dtype"] is torch.bfloat16
assert zs.verify(path) > 0
with zs.open(path) as ck:
    assert isinstance(ck, zs.Checkpoint) and ck.step == 7
from zerostall import *
from zerostall import CheckpointManager, CorruptCheckpointError, verify
import zerostall.api, zerostall.errors, zerostall.manager
assert verify is zs.verify is zerostall.api.verify
assert CorruptCheckpointError is zerostall.errors.CorruptCheckpointError and CheckpointManager is zerostall.manager.CheckpointManager
assert zs.format.layout.FORMAT_VERSION == zs.FORMAT_VERSION
try:
    zs.no_such_name
except AttributeError:
    pass
else:
    raise AssertionError("zs.no_such_name")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_every_public_name_is_its_module_s() -> None:
    """``__all__``, the lazy table and the imports that type checkers see name the same objects."""
    init = Path(zs.__file__)
    typed = {}
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1
                typed.update({alias.name: imp.module for alias in imp.names})
    assert typed == zs._EXPORTS
    assert sorted(zs.__all__) == sorted(zs._EXPORTS) and set(zs.__all__) <= set(dir(zs))
    for name, module in zs._EXPORTS.items():
        assert getattr(zs, name) is getattr(sys.modules[f"zerostall.{module}"], name)


def test_the_safetensors_dtype_table_names_torch_dtypes() -> None:
    """The table gives the manifest's dtype names (no torch at import): each is a real dtype's, and
    the safetensors name written for it is the one read back."""
    from zerostall.format.layout import SAFETENSORS_DTYPES, dtype_from_name, dtype_name
    from zerostall.format.safetensors_file import safetensors_dtype

    assert all(dtype_name(dtype_from_name(name)) == name for name in SAFETENSORS_DTYPES.values())
    assert safetensors_dtype(torch.bfloat16) == "BF16" and safetensors_dtype(torch.complex64) is None
    for st, name in SAFETENSORS_DTYPES.items():
        assert safetensors_dtype(dtype_from_name(name)) in (st, None)
