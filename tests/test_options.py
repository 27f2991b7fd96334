"""Options objects: checked when built, a misspelt keyword fails when it is given (before any byte
is written or loaded), keywords override an object's fields, and docs/options.md is the reference
generated from the dataclasses' field docstrings (``python tests/test_options.py`` rewrites it)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import sys
from pathlib import Path

import pytest
import torch

import zerostall as zs

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "options.md"
SOURCES = {"SaveOptions": "options.py", "LoadOptions": "options.py", "RetentionPolicy": "roots/retention.py",
           "S3Options": "storage/s3client.py", "ExportOptions": "interop/exporting.py", "LocalTier": "tiers/local.py",
           "DeepSpeedOptions": "integrations/deepspeed/engine.py",
           "LightningOptions": "integrations/lightning/checkpoint_io.py"}


def options_class(name: str) -> type:
    """The class, from the public names or (an integration's) its own module."""
    if hasattr(zs, name):
        return getattr(zs, name)
    module = "zerostall." + SOURCES[name].removesuffix(".py").replace("/", ".")
    return getattr(importlib.import_module(module), name)


def title(name: str) -> str:
    if hasattr(zs, name):
        return f"zs.{name}"
    module = SOURCES[name].removesuffix(".py").replace("/", ".")
    return f"zerostall.{module.rsplit('.', 1)[0] if module.startswith('integrations.') else module}.{name}"


def field_docs(cls_name: str) -> tuple[str, dict[str, str]]:
    """The class docstring and each field's docstring (the string right under it), from the source."""
    tree = ast.parse((ROOT / "src" / "zerostall" / SOURCES[cls_name]).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    docs: dict[str, str] = {}
    body = node.body
    for here, after in zip(body, body[1:] + [None]):
        if isinstance(here, ast.AnnAssign) and isinstance(here.target, ast.Name):
            text = after.value.value if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                                         and isinstance(after.value.value, str)) else ""
            docs[here.target.id] = " ".join(text.split())
    return " ".join((ast.get_docstring(node) or "").split()), docs


def render() -> str:
    """docs/options.md as the dataclasses say it should be."""
    out = ["# Options reference", "",
           "Generated from the dataclasses' field docstrings (`src/zerostall/options.py`, "
           "`src/zerostall/roots/retention.py`, `src/zerostall/storage/s3client.py`, `src/zerostall/interop/exporting.py`, "
           "`src/zerostall/tiers/local.py`, `src/zerostall/integrations/deepspeed/engine.py`, "
           "`src/zerostall/integrations/lightning/checkpoint_io.py`); "
           "`tests/test_options.py` checks "
           "that it matches them. A "
           "function that takes an options object also takes its fields as keywords: "
           "`zs.save(state, path, fsync=False)` is `zs.save(state, path, zs.SaveOptions(fsync=False))`. "
           "`CheckpointManager` takes the fields of `SaveOptions` and `RetentionPolicy` as keywords, and "
           "`LoadOptions` as `load_options=` (or as keywords of its `open` and `restore`); `S3Storage` takes "
           "an `S3Options` only.", ""]
    for name in SOURCES:
        cls = options_class(name)
        doc, docs = field_docs(name)
        out += [f"## `{title(name)}`", "", doc, "", "| field | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f"`{f.default!r}`"
            elif f.default_factory is not dataclasses.MISSING:
                default = f"`{f.default_factory()!r}`"
            else:
                default = "(required)"
            out.append(f"| `{f.name}` | {default} | {docs.get(f.name, '')} |")
        out.append("")
    return "\n".join(out)


def test_every_field_has_a_docstring():
    for name in SOURCES:
        _, docs = field_docs(name)
        fields = [f.name for f in dataclasses.fields(options_class(name))]
        assert sorted(docs) == sorted(fields)
        assert all(docs[f] for f in fields), f"{name}: fields without a docstring: {[f for f in fields if not docs[f]]}"


def test_the_options_reference_matches_the_dataclasses():
    assert DOC.read_text() == render(), "docs/options.md is stale: run `python tests/test_options.py`"


@pytest.mark.parametrize("cls, field, value", [
    (zs.SaveOptions, "threads", 0), (zs.SaveOptions, "fsync", "yes"), (zs.SaveOptions, "block_size", 0),
    (zs.SaveOptions, "block_size", (1 << 30) + 1),
    (zs.SaveOptions, "commit_timeout", -1), (zs.SaveOptions, "allow_pickle", 1),
    (zs.LoadOptions, "max_staging_bytes", -1), (zs.LoadOptions, "strict", None), (zs.LoadOptions, "strip", [1]),
    (zs.LoadOptions, "prefix", 3), (zs.LoadOptions, "keys", 5), (zs.LoadOptions, "threads", 1.5),
    (zs.S3Options, "part_size", 1 << 20), (zs.S3Options, "concurrency", 0), (zs.S3Options, "addressing_style", "dns"),
    (zs.S3Options, "read_timeout", 0), (zs.S3Options, "endpoint_url", 9000), (zs.S3Options, "conditional_writes", 1),
])
def test_a_bad_value_fails_when_built_naming_the_field(cls, field, value):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field} must be"):
        cls(**{field: value})


def test_a_single_strip_name_is_one_segment():
    assert zs.LoadOptions(strip="module").strip == ("module",)


def test_a_misspelt_save_option_fails_before_anything_is_written(tmp_path):
    path = tmp_path / "ck"
    with pytest.raises(TypeError, match="'fsyn' is not a SaveOptions field; did you mean 'fsync'"):
        zs.save({"w": torch.ones(2)}, path, fsyn=False)
    assert not path.exists()
    saver = zs.AsyncSaver()
    with pytest.raises(TypeError, match="'treads' is not a SaveOptions field; did you mean 'threads'"):
        saver.save({"w": torch.ones(2)}, path, treads=2)
    saver.close()
    assert not path.exists()


def test_a_misspelt_load_option_fails_before_anything_is_read(tmp_path):
    zs.save({"w": torch.ones(2)}, tmp_path / "ck")
    target = {"w": torch.zeros(2)}
    with pytest.raises(TypeError, match="'stric' is not a LoadOptions field; did you mean 'strict'"):
        zs.load(target, tmp_path / "ck", stric=False)
    with zs.open(tmp_path / "ck") as ck, pytest.raises(TypeError, match="did you mean 'prefix'"):
        ck.load(target, prefx="w")
    assert torch.equal(target["w"], torch.zeros(2))


def test_an_options_object_of_the_wrong_kind_is_refused(tmp_path):
    with pytest.raises(TypeError, match="options must be a zerostall.SaveOptions, not LoadOptions"):
        zs.save({"w": torch.ones(2)}, tmp_path / "ck", zs.LoadOptions())


def test_keywords_override_the_options_object(tmp_path):
    zs.save({"w": torch.arange(8.0)}, tmp_path / "ck", zs.SaveOptions(block_size=1 << 20), block_size=8)
    with zs.open(tmp_path / "ck") as ck:
        assert ck.manifest.block_size == 8
        assert len(ck.entries["w"].chunks[0].checksums) == 4  # 32 bytes in blocks of 8
    target, mismatch = zs.load({"w": torch.zeros(8), "extra": torch.zeros(1)}, tmp_path / "ck",
                               zs.LoadOptions(strict=True), strict=False)
    assert torch.equal(target["w"], torch.arange(8.0)) and mismatch.missing == ["extra"]


def test_a_session_s_options_are_its_loads_defaults(tmp_path):
    zs.save({"model": {"w": torch.ones(3)}, "step": 7}, tmp_path / "ck")
    with zs.open(tmp_path / "ck", prefix="model") as ck:
        out = ck.load({"w": torch.zeros(3)})
        assert torch.equal(out["w"], torch.ones(3))
        whole = ck.load({"model": {"w": torch.zeros(3)}, "step": 0}, prefix=())  # a keyword overrides the session's
        assert whole["step"] == 7 and torch.equal(whole["model"]["w"], torch.ones(3))


if __name__ == "__main__":
    DOC.write_text(render())
    sys.stdout.write(f"wrote {DOC}\n")
