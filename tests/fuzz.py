"""The hostile-manifest and corruption fuzzer: every outcome is a typed error or an exact result.

Each case takes a real checkpoint written by ``zs.save`` (one stored whole, one whose tensor is
stored as a grid of chunks, one with a small block size) and damages it with one to three
generators: random mutations of manifest fields re-enveloped with a valid checksum (interesting
values, numbers off by a little, fields dropped, copied from elsewhere in the manifest or from
another checkpoint, values nested hundreds deep), the issue's targeted lies (files outside the
checkpoint, block sizes, dtypes, shapes, chunks split into overlapping or gapped pieces, aliases
and tree references elsewhere, new block checksums, value tags out of range), and damage to files (flipped, truncated,
extended or zeroed bytes, data files swapped, replaced by symbolic links, FIFOs, directories or
devices, a huge sparse manifest). Then it reads the case every way there is (open, load, read,
state, verify, listing, the CLI), each under a watchdog, and records a violation for:

- an exception that is not a zerostall error (``KeyError`` from ``read`` of a name that is gone
  excepted), or a CLI command that lets one escape;
- a hang (a call still running after ``--wait`` seconds);
- a tensor that is not bit-identical to the saved tensor the (damaged) manifest names for it
  (loads are strict about dtypes, so a value is never converted from a lie);
- a ``verify`` that passes although bytes of the data files changed;
- a file opened outside the checkpoint.

Usage: ``python tests/fuzz.py [--seconds S] [--cases N] [--seed N] [--case K]``. The seed is
printed; ``--seed S --case K`` replays one case. Exit status 1 when there is any violation.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import resource
import shutil
import stat
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import xxhash  # noqa: E402
from torch.testing._internal.two_tensor import TwoTensor  # noqa: E402
from torch.utils._python_dispatch import is_traceable_wrapper_subclass  # noqa: E402

import zerostall as zs  # noqa: E402
from hostile import MANIFEST, cli_outcome, compact, data_files, opened, read_body, under, within, write_body  # noqa: E402
from zerostall.format.codec import decode_path  # noqa: E402
from zerostall.format.layout import dump_json  # noqa: E402
from zerostall.roots.root import CheckpointRoot, step_tag  # noqa: E402
from zerostall.saving.pipeline import persist, prepare  # noqa: E402
from zerostall.storage import LocalStorage  # noqa: E402


STEP1, STEP2 = step_tag(1), step_tag(2)  # the incremental pair's checkpoints


def original() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    b = torch.randn(3000, generator=g).to(torch.bfloat16)
    return {"w": torch.randn(20, 15, generator=g, dtype=torch.float64), "b": b, "tied": b,
            "i": torch.arange(7, dtype=torch.int32), "rope": torch.randn(6, generator=g, dtype=torch.complex64),
            "flags": torch.tensor([True, False, True]), "s": torch.tensor(2.5), "e": torch.zeros(0, 4),
            "layers": {0: torch.ones(2, 3, dtype=torch.int64)}, "step": 12,
            "two": TwoTensor(torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)),  # a tensor subclass
            "opts": {"betas": (0.9, 0.999), "eps": float("inf"), "name": "run", "tags": {1: b"x"}}}


def tensors(value: Any, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], torch.Tensor]:
    """The tensor leaves of a state by key path."""
    if isinstance(value, torch.Tensor):
        return {path: value}
    found: dict[tuple[Any, ...], torch.Tensor] = {}
    if isinstance(value, dict):
        for k, v in value.items():
            found.update(tensors(v, path + (k,)))
    elif type(value) in (list, tuple):
        for i, v in enumerate(value):
            found.update(tensors(v, path + (i,)))
    return found


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes (a wrapper subclass's: its inner tensors', in order)."""
    if is_traceable_wrapper_subclass(t):
        return b"".join(raw(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


SAVED = {path: raw(t) for path, t in tensors(original()).items()}
GENUINE = {*SAVED.values(), *(raw(getattr(t, name)) for t in tensors(original()).values()
                              if is_traceable_wrapper_subclass(t) for name in t.__tensor_flatten__()[0])}


def zeros_like(state: Any) -> Any:
    if is_traceable_wrapper_subclass(state):
        return TwoTensor(torch.zeros_like(state.a), torch.zeros_like(state.b))
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    return None


# -- the pristine checkpoints --------------------------------------------------------------------

def carve_grid(path: str) -> None:
    """Store ``w`` anew as a grid of 2 x 3 chunks in a new data file, with true checksums."""
    body = read_body(path)
    name = data_files(path)[0].replace("-000.safetensors", "-007.safetensors")
    w = original()["w"]
    blob, chunks = bytearray(), []
    for r0, r1 in ((0, 9), (9, 20)):
        for c0, c1 in ((0, 4), (4, 11), (11, 15)):
            part = raw(w[r0:r1, c0:c1])
            chunks.append({"offsets": [r0, c0], "sizes": [r1 - r0, c1 - c0], "file": name, "offset": len(blob),
                           "nbytes": len(part), "checksums": block_checksums(part, body["block_size"])})
            blob += part
    with open(os.path.join(path, name), "wb") as f:
        f.write(blob)
    body["files"][name] = len(blob)
    body["headers"][name] = xxhash.xxh3_64_hexdigest(b"")  # no header: its data starts at 0
    next(e for e in body["entries"] if e["fqn"] == "w")["chunks"] = chunks
    write_body(path, body)


def block_checksums(data: bytes, block: int) -> list[str]:
    return [xxhash.xxh3_64_hexdigest(data[i:i + block]) for i in range(0, max(len(data), 1), block)]


def pristine(where: str) -> dict[str, str]:
    """The checkpoints cases start from, and another one beside them (``other``)."""
    paths = {name: os.path.join(where, name) for name in ("whole", "grid", "blocks", "other")}
    zs.save(original(), paths["whole"], step=12, metadata={"metrics": {"loss": 0.5}, "note": [1, (2, 3)]})
    shutil.copytree(paths["whole"], paths["grid"])
    carve_grid(paths["grid"])
    zs.save(original(), paths["blocks"], block_size=64, threads=2)
    other = original()
    other["w"] = other["w"] + 1
    zs.save(other, paths["other"])
    paths["incremental"] = incremental_pair(os.path.join(where, "incremental"), other)
    return paths


def incremental_pair(root: str, first: dict[str, Any]) -> str:
    """A root holding ``first`` as step 1 and the original state as step 2, an incremental save
    that writes ``w`` (changed) and refers to step 1's bytes for every other tensor."""
    options = zs.SaveOptions(incremental=True)
    step1 = persist(prepare(first, os.path.join(root, STEP1), options))
    persist(prepare(original(), os.path.join(root, STEP2), options, reuse=step1.reuse))
    return root


def damage_referenced(rng: random.Random, path: str, body: dict[str, Any]) -> str:
    """Flip a byte of a chunk that the case refers to in step 1's data file."""
    chunks = [c for e in tensor_entries(body) for c in e["chunks"] if c["file"] in body.get("refs", {}) and c["nbytes"]]
    chunk = rng.choice(chunks)
    at = chunk["offset"] + rng.randrange(chunk["nbytes"])
    with open(os.path.join(os.path.dirname(path), STEP1, chunk["file"]), "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ rng.randrange(1, 256)]))
    return f"flip referenced {chunk['file']} byte {at}"


# -- generators ------------------------------------------------------------------------------------

INTS = [-(1 << 63), -(1 << 31), -2, -1, 0, 1, 2, 3, 7, 8, 15, 16, 64, 4095, 4096, 4097, 1 << 20, 4 << 20,
        (1 << 30) + 1, 1 << 31, 1 << 32, 1 << 33, (1 << 53) + 1, (1 << 62), (1 << 63) - 1, 1 << 63, 1 << 64, 10 ** 30]
STRINGS = ["", "a", ".", "..", "/", "a/b", "nul\0byte", "../other/x", "/proc/self/mem", "/dev/zero", "/etc/passwd",
           MANIFEST, "latest", "0" * 16, "f" * 17, "float32", "float", "qint8", "bits8", "float64", "bool", "tensor",
           "object", "alias", "xxh3_64", "$ref", "1-2", "é", "\ud800"]
TAGS = ["$tuple", "$dict", "$float", "$bytes", "$complex", "$set", "$frozenset", "$dtype", "$size", "$device",
        "$ndarray", "$npscalar", "$ref", "$pickle", "$nope"]


DEEP: dict[str, bytes] = {}  # placeholder -> JSON text of a value nested deeper than json.dumps recurses


def nested(rng: random.Random, inner: Any = None) -> dict[str, str]:
    """A value nested hundreds or thousands of containers deep (lists, tuples, dicts) around
    ``inner``, as a placeholder that :func:`dump` replaces by its text."""
    text = dump_json(inner if inner is not None else rng.choice([1, "x", {"$ref": 0}, []]))
    opens, closes = [], []
    for _ in range(rng.choice([99, 100, 101, 150, 300, 1000, 3000])):
        o, c = rng.choice([(b"[", b"]")] * 5 + [(b'{"$tuple":[', b"]}"), (b'{"k":', b"}"), (b'{"$dict":[[1,', b"]]}")])
        opens.append(o)
        closes.append(c)
    key = f"deep{len(DEEP)}"
    DEEP[key] = b"".join(opens) + text + b"".join(reversed(closes))
    return {"__fuzz_deep__": key}


def dump(body: Any) -> bytes:
    """``body`` as compact JSON (chunks as the version writes them), deep placeholders replaced by their text."""
    text = dump_json(compact(body))
    for key, deep in DEEP.items():
        text = text.replace(b'{"__fuzz_deep__":"%s"}' % key.encode(), deep)
    return text


def interesting(rng: random.Random, near: Any = None) -> Any:
    roll = rng.random()
    if isinstance(near, int) and not isinstance(near, bool) and roll < 0.35:
        return near + rng.choice([-16, -8, -4, -2, -1, 1, 2, 4, 8, 16, near, -2 * near, 4096, -4096])
    if roll < 0.55:
        return rng.choice(INTS)
    if roll < 0.7:
        return rng.choice(STRINGS)
    if roll < 0.75:
        return rng.choice([True, False, None, 0.5, -0.0, 1e308, 4096.0])
    if roll < 0.9:
        body = rng.choice([None, 1, "x", [], [1], [[1]], ["a", "b"], [1, 2, 3], {}, {"a": 1}, ["|O", [1], "AA=="],
                           ["<f4", [2], "AAAAAAAAAAA="], [1e308, "nan"], "AAAA", "!!", [[1, 2]], [[[1], 2]],
                           [1 << 64], ["<f4", [0, 1 << 64], ""], [10 ** 400, 0.0]])
        return {rng.choice(TAGS): body}
    if roll < 0.95:
        return nested(rng)
    return rng.choice([[], {}, [None], {"$ref": -1}, {"a": 1, "$b": 2}])


def locations(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, Any, tuple[Any, ...]]]:
    """Every (container, key, path) in a JSON value, for a mutation to pick from."""
    found = []
    if isinstance(node, dict):
        items = list(node.items())
    elif isinstance(node, list):
        items = list(enumerate(node))
    else:
        return found
    for k, v in items:
        found.append((node, k, at + (k,)))
        if len(at) < 12:
            found.extend(locations(v, at + (k,)))
    return found


def mutate_field(rng: random.Random, body: dict[str, Any], other: dict[str, Any]) -> str:
    """One random change of one node of the manifest body."""
    places = locations(body)
    parent, key, at = rng.choice(places)
    how = rng.choice(["value", "value", "value", "drop", "copy", "other", "dup", "nest"])
    where = "/".join(map(str, at))
    if how == "value":
        parent[key] = interesting(rng, parent[key])
    elif how == "drop":
        del parent[key]
    elif how == "copy":
        parent[key] = json.loads(json.dumps(_pick_value(rng, places)))
    elif how == "other":
        node: Any = other
        try:
            for k in at:
                node = node[k]
        except (KeyError, IndexError, TypeError):
            node = _pick_value(rng, locations(other))
        parent[key] = json.loads(json.dumps(node))
    elif how == "dup" and isinstance(parent, list):
        parent.insert(rng.randrange(len(parent) + 1), json.loads(json.dumps(parent[key])))
    else:
        parent[key] = nested(rng, parent[key])
    return f"{how} {where}"


def _pick_value(rng: random.Random, places: list[tuple[Any, Any, tuple[Any, ...]]]) -> Any:
    parent, key, _ = rng.choice(places)
    return parent[key]


def tensor_entries(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in body.get("entries", []) if isinstance(e, dict) and e.get("kind") == "tensor"]


def targeted(rng: random.Random, body: dict[str, Any], other: dict[str, Any], path: str, others: str) -> str:
    """One of the lies the issue names, built to pass every check but the one it is about."""
    entries = tensor_entries(body)
    e = rng.choice(entries)
    chunk = rng.choice(e["chunks"]) if e["chunks"] else None
    kind = rng.choice(["outside", "block", "rechecksum", "dtype", "shape", "split", "alias", "ref", "value", "offset"]
                      + ["refs"] * 4 * bool(body.get("refs")))
    if kind == "refs":  # an incremental checkpoint's references: elsewhere, resized, dropped, moved
        refs = body["refs"]
        name = rng.choice(sorted(refs))
        how = rng.choice(["tag", "size", "drop", "move"])
        if how == "tag":
            refs[name] = rng.choice(STRINGS + [STEP2, "step_000000003", "other", "latest", "retained.json"])
        elif how == "size":
            body["files"][name] += rng.choice([-1, 1, 4096])
        elif how == "drop":
            del refs[name]
        else:
            used = [c for x in entries for c in x["chunks"] if c["file"] == name]
            rng.choice(used)["offset"] += rng.choice([-8, -2, 2, 8, 4096])
        return f"refs {how} {name}"
    if kind == "outside" and chunk:
        theirs = next(x for x in tensor_entries(other) if x["fqn"] == e["fqn"])["chunks"][0]
        name = rng.choice([f"../other/{theirs['file']}", os.path.join(others, theirs["file"]), "/proc/self/mem"])
        body["files"][name] = other["files"].get(theirs["file"], 1 << 40)
        chunk.update({**theirs, "file": name})
        return f"outside {e['fqn']} -> {name}"
    if kind in ("block", "rechecksum"):
        block = rng.choice([-1, 0, 1, 3, 12, 100, 4096, 1 << 30, (1 << 30) + 1, 1 << 33])
        body["block_size"] = block
        if kind == "rechecksum" and 1 <= block <= 1 << 30:
            for x in tensor_entries(body):
                for c in x["chunks"]:
                    c["checksums"] = block_checksums(file_bytes(path, c["file"], c["offset"], c["nbytes"]), block)
        return f"{kind} {block}"
    if kind == "dtype":
        e["dtype"] = rng.choice(["float32", "int32", "float64", "int64", "bfloat16", "float16", "uint8", "bool",
                                 "complex128", "uint4", "float8_e4m3fn", "qint8", "float", "nope"])
        return f"dtype {e['fqn']} {e['dtype']}"
    if kind == "shape" and chunk:
        n = math.prod(e["shape"])
        e["shape"] = rng.choice([[n], [1, n], [n, 1], list(reversed(e["shape"])), [n + 1], [max(n - 1, 0)], []])
        if len(e["chunks"]) == 1:
            chunk.update(offsets=[0] * len(e["shape"]), sizes=list(e["shape"]))
        return f"shape {e['fqn']} {e['shape']}"
    if kind == "split" and chunk and e["shape"] and e["shape"][0] > 2 and chunk["sizes"] == e["shape"]:
        rows, row = e["shape"][0], chunk["nbytes"] // e["shape"][0]
        cut = rng.randrange(1, rows)
        spans = [(0, cut), (cut + rng.choice([0, 0, -1, 1]), rows)]
        e["chunks"] = [{**chunk, "offsets": [a] + [0] * (len(e["shape"]) - 1), "sizes": [b - a] + e["shape"][1:],
                        "offset": chunk["offset"] + a * row, "nbytes": (b - a) * row,
                        "checksums": block_checksums(file_bytes(path, chunk["file"], chunk["offset"] + a * row,
                                                                (b - a) * row), body["block_size"])}
                       for a, b in spans if 0 <= a <= b <= rows]
        return f"split {e['fqn']} {spans}"
    if kind == "alias":
        alias = next(x for x in body["entries"] if x.get("kind") == "alias")
        alias["alias_of"] = rng.randrange(-1, len(body["entries"]) + 1)
        return f"alias_of {alias['alias_of']}"
    if kind == "value":  # well-formed tags of values out of range: decoded, they failed only when shown or used
        value = next(x for x in body["entries"] if x.get("kind") == "object" and x.get("fqn") == "opts")
        value["value"] = rng.choice([{"$size": [1 << 64]}, {"$size": [-(1 << 63) - 1]}, {"$complex": [10 ** 400, 0.0]},
                                     {"$ndarray": ["<f4", [0, 1 << 64], ""]}, {"$dict": [[{"$size": [10 ** 30]}, 1]]}])
        return f"value opts {value['value']}"
    if kind == "ref":
        refs = [loc for loc in locations(body["tree"]) if isinstance(loc[0][loc[1]], dict) and "$ref" in loc[0][loc[1]]]
        parent, key, at = rng.choice(refs)
        parent[key] = {"$ref": rng.randrange(-1, len(body["entries"]) + 1)}
        return f"tree ref {at}"
    if chunk:
        chunk["offset"] += rng.choice([-4096, -1, 1, 2, 4, 8, 4096])
        return f"offset {e['fqn']}"
    return "nothing"


def file_bytes(path: str, name: str, offset: int, n: int) -> bytes:
    """Up to ``n`` bytes of data file ``name`` from ``offset`` (an earlier mutation of the same case
    may have made either anything: then what lies there, or nothing)."""
    if not (type(name) is str and type(offset) is int and type(n) is int and offset >= 0 and n >= 0):
        return b""
    with open(os.path.join(path, os.path.basename(name)), "rb") as f:
        f.seek(offset)
        return f.read(max(0, min(n, os.fstat(f.fileno()).st_size - offset)))


def damage_file(rng: random.Random, path: str, others: str, fifos: list[str]) -> str:
    """Damage to a file of the checkpoint; returns what was done."""
    names = data_files(path)
    name = rng.choice(names)
    file = os.path.join(path, name)
    size = os.path.getsize(file)
    how = rng.choice(["flip", "flip", "flip", "truncate", "extend", "zero", "swap", "link", "link-zero", "fifo", "dir",
                      "empty", "remove", "manifest-flip", "manifest-fifo", "manifest-huge", "manifest-dir"])
    if how == "flip" and size:
        at = rng.randrange(size)
        with open(file, "r+b") as f:
            f.seek(at)
            b = f.read(1)[0]
            f.seek(at)
            f.write(bytes([b ^ rng.randrange(1, 256)]))
        return f"flip {name} byte {at}"
    if how == "truncate" and size:
        os.truncate(file, rng.randrange(size))
    elif how == "extend":
        with open(file, "ab") as f:
            f.write(os.urandom(rng.choice([1, 7, 4096])))
    elif how == "zero" and size:
        at = rng.randrange(size)
        n = rng.randrange(1, min(size - at, 5000) + 1)
        if file_bytes(path, name, at, n) == bytes(n):
            return "nothing"
        with open(file, "r+b") as f:
            f.seek(at)
            f.write(bytes(n))
        return f"zero {name} {at}+{n}"
    elif how == "swap" and len(names) > 1:
        a, b = os.path.join(path, names[0]), os.path.join(path, names[1])
        os.rename(a, a + ".x")
        os.rename(b, a)
        os.rename(a + ".x", b)
        name = f"{names[0]} <-> {names[1]}"
    elif how == "link":
        target = os.path.join(others, rng.choice(data_files(others)))
        os.remove(file)
        os.symlink(target, file)
    elif how == "link-zero":
        os.remove(file)
        os.symlink("/dev/zero", file)
    elif how == "fifo":
        os.remove(file)
        os.mkfifo(file)
        fifos.append(file)
    elif how == "dir":
        os.remove(file)
        os.mkdir(file)
    elif how == "empty":
        open(file, "wb").close()
    elif how == "remove":
        os.remove(file)
    elif how.startswith("manifest"):
        manifest = os.path.join(path, MANIFEST)
        if how == "manifest-flip":
            data = bytearray(open(manifest, "rb").read())
            data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
            open(manifest, "wb").write(bytes(data))
        elif how == "manifest-fifo":
            os.remove(manifest)
            os.mkfifo(manifest)
            fifos.append(manifest)
        elif how == "manifest-huge":
            os.truncate(manifest, (1 << 30) + rng.randrange(1, 1 << 31))
        else:
            os.remove(manifest)
            os.mkdir(manifest)
        return how
    else:
        return "nothing"
    return f"{how} {name}"


def garbage_body(rng: random.Random, body: dict[str, Any]) -> bytes:
    """A body that is not the manifest's JSON, re-enveloped."""
    text = dump(body)
    roll = rng.randrange(6)
    if roll == 0:
        return os.urandom(rng.randrange(1, 200))
    if roll == 1:
        return rng.choice([b"[]", b"null", b"1", b'"x"', b"{}", b'{"format":"zerostall"}'])
    if roll == 2:
        at = rng.randrange(len(text))
        return text[:at] + rng.choice([b"NaN", b"Infinity", b"123456789012345678901234567890", b"-0", b'"\\ud800"',
                                       b'{"a":1,"a":2}', b"[" * 5000 + b"]" * 5000]) + text[at:]
    if roll == 3:
        return text.replace(b'"format":"zerostall"', b'"format":"zerostall","format":"other"', 1)
    if roll == 4:
        return text[:rng.randrange(len(text))]
    return text.replace(b'"version":4', rng.choice([b'"version":3', b'"version":5', b'"version":0', b'"version":4.0']), 1)


# -- the oracle ------------------------------------------------------------------------------------

class Resolver:
    """What the damaged manifest says each key path or name holds: the saved tensor of the path an
    entry (or the tensor entry it aliases) has, so that a result can be compared bit for bit."""

    def __init__(self, path: str) -> None:
        try:  # the fuzzer's own read: never a FIFO, a device or a huge file
            st = os.lstat(os.path.join(path, MANIFEST))
            assert stat.S_ISREG(st.st_mode) and st.st_size < 1 << 26
            self.entries = read_body(path)["entries"]
            assert isinstance(self.entries, list)
        except Exception:  # noqa: BLE001 - no usable manifest: nothing may be returned
            self.entries = []

    def _path(self, e: Any) -> tuple[Any, ...] | None:
        try:
            return decode_path(e["path"])
        except Exception:  # noqa: BLE001
            return None

    def expected(self, e: Any) -> bytes | None:
        try:
            if e.get("kind") == "alias":
                e = self.entries[e["alias_of"]]
            return SAVED.get(self._path(e))
        except Exception:  # noqa: BLE001
            return None

    def at_path(self, path: tuple[Any, ...]) -> list[bytes | None]:
        return [self.expected(e) for e in self.entries if isinstance(e, dict) and self._path(e) == path]

    def named(self, fqn: str) -> bytes | None:
        for e in self.entries:
            if isinstance(e, dict) and e.get("fqn") == fqn and e.get("rank") is None:
                return self.expected(e)
        return None


def check_case(path: str, others: str, fifos: list[str], data_changed: bool, wait: float,
               cli: bool) -> list[str]:
    """Read the case every way; the violations found."""
    problems: list[str] = []
    resolver = Resolver(path)

    def exact(how: str, got: torch.Tensor, wanted: list[bytes | None]) -> None:
        """``got`` is the saved tensor the manifest names; where the manifest's key paths no longer
        name a saved one (it was changed), at least one of the saved tensors, bit for bit."""
        data = raw(got)
        if data not in wanted and not (None in wanted and data in GENUINE):
            problems.append(f"{how}: returned a tensor that is not the saved one the manifest names")

    def run(how: str, call: Callable[[], Any], allowed: tuple[type, ...] = ()) -> Any:
        hung, outcome = within(wait, call, tuple(fifos))
        if hung:
            problems.append(f"{how}: hung for more than {wait} s")
            return None
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, (zs.CheckpointError, *allowed)):
                problems.append(f"{how}: {type(outcome).__name__}: {outcome}\n"
                                + "".join(traceback.format_exception(outcome)[-6:]))
            return None
        return outcome

    def load() -> Any:
        return zs.load(zeros_like(original()), path, strict_dtype=True)

    def read_all() -> dict[str, Any]:
        with zs.open(path) as ck:
            got = {}
            for name in ("w", "b", "tied", "i", "rope", "flags", "s", "e", "layers.0", "opts", "step"):
                try:
                    got[name] = ck.read(name)
                except KeyError:
                    pass
                except zs.CheckpointError as exc:
                    got[name] = exc
            return got

    def whole() -> Any:
        with zs.open(path) as ck:
            state = ck.state()
        repr(shown(state))  # a value that cannot even be shown (a torch.Size of ints beyond 64 bits) is a lie let through
        return state

    def shown(value: Any) -> Any:
        """``value`` with each tensor as its dtype and shape: torch cannot print sub-byte dtypes (uint4)."""
        if isinstance(value, torch.Tensor):
            return (value.dtype, value.shape)
        if isinstance(value, dict):
            return {k: shown(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [shown(v) for v in value]
        return value

    with opened() as paths:
        run("open", lambda: zs.open(path).close())
        loaded = run("load", load)
        if loaded is not None:
            for p, t in tensors(loaded).items():
                exact(f"load {p}", t, resolver.at_path(p))
        got = run("read", read_all)
        for name, value in (got or {}).items():
            if isinstance(value, torch.Tensor):
                exact(f"read {name}", value, [resolver.named(name)])
            elif isinstance(value, BaseException) and not isinstance(value, zs.CheckpointError):
                problems.append(f"read {name}: {value!r}")
        state = run("state", whole)
        if state is not None:
            for p, t in tensors(state).items():
                exact(f"state {p}", t, resolver.at_path(p))
        checked = run("verify", lambda: zs.verify(path))
        if checked is not None and data_changed:
            problems.append("verify: passed although the data files changed")
        if cli:
            for args in (("inspect", path), ("verify", path)):
                cli_run(run, problems, *args)
    reached = under(paths, others, "/proc/self/mem", "/dev/zero")
    if reached:
        problems.append(f"opened outside the checkpoint: {sorted(set(reached))}")
    root = CheckpointRoot(LocalStorage(os.path.dirname(path)))  # lists `other` too: after the recording
    run("list", lambda: (root.checkpoints(), root.scan()))
    if cli:
        cli_run(run, problems, "ls", os.path.dirname(path))
    return problems


def cli_run(run: Callable[..., Any], problems: list[str], *args: str) -> None:
    """``zerostall ARGS``: an exit status it documents, and no exception or traceback escapes."""
    outcome = run(f"cli {args[0]}", lambda: cli_outcome(*args))
    if outcome is not None and (outcome[2] is not None or outcome[0] not in (0, 1, 2, 3) or "Traceback" in outcome[1]):
        problems.append(f"cli {args[0]}: exit {outcome[0]}, {outcome[2]!r}, {outcome[1][-300:]}")


# -- the runner ------------------------------------------------------------------------------------

def make_case(seed: int, index: int, base: dict[str, str], work: str) -> tuple[str, list[str], list[str], bool]:
    """Build case ``index`` of ``seed`` in ``work``: (its path, what was done, its FIFOs, whether
    data bytes changed)."""
    rng = random.Random(f"{seed}:{index}")
    DEEP.clear()
    kind = rng.choice(["whole", "grid", "blocks", "incremental"])
    case = os.path.join(work, f"case{index}")
    path, others = os.path.join(case, "ck"), os.path.join(case, "other")
    if kind == "incremental":  # the case is step 2, which refers to step 1 beside it
        shutil.copytree(base[kind], os.path.join(case, "root"))
        path = os.path.join(case, "root", STEP2)
    else:
        shutil.copytree(base[kind], path, symlinks=True)
    shutil.copytree(base["other"], others)
    body, other = read_body(path), read_body(others)
    done, fifos, data_changed = [kind], [], False
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        roll = rng.random()
        if roll < 0.7:
            generate = mutate_field if roll < 0.45 else functools.partial(targeted, path=path, others=others)
            try:
                done.append(generate(rng, body, other))
            except (LookupError, TypeError, ValueError, AttributeError, StopIteration, OSError) as exc:
                done.append(f"(a generator found no place after the changes before: {exc!r})")
        elif kind == "incremental" and roll > 0.95:
            write_body(path, dump(body))
            try:
                done.append(damage_referenced(rng, path, body))
            except (LookupError, TypeError, ValueError, AttributeError, OSError) as exc:  # an earlier lie's doing
                done.append(f"(no referenced chunk to damage after the changes before: {exc!r})")
                return path, done, fifos, False
            return path, done, fifos, True
        elif roll < 0.78:
            write_body(path, garbage_body(rng, body))
            done.append("garbage body")
            return path, done, fifos, data_changed
        else:
            write_body(path, dump(body))
            what = damage_file(rng, path, others, fifos)
            done.append(what)
            data_changed = data_changed or not what.startswith(("nothing", "manifest"))
            return path, done, fifos, data_changed
    write_body(path, dump(body))
    return path, done, fifos, data_changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="stop starting cases after this long")
    parser.add_argument("--cases", type=int, default=None, help="at most this many cases")
    parser.add_argument("--seed", type=int, default=None, help="default: a random seed (printed)")
    parser.add_argument("--case", type=int, default=None, help="run only this case of the seed")
    parser.add_argument("--wait", type=float, default=20.0, help="seconds after which a call has hung")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)  # an allocation from a lie fails, the machine lives
    resource.setrlimit(resource.RLIMIT_AS, (min(16 << 30, hard if hard >= 0 else 16 << 30), hard))
    print(f"fuzz: seed {seed} (replay a case: python tests/fuzz.py --seed {seed} --case K)", flush=True)
    violations, count, start = 0, 0, time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zerostall-fuzz-") as work:
        base = pristine(os.path.join(work, "pristine"))
        indices = [args.case] if args.case is not None else range(args.cases or sys.maxsize)
        for index in indices:
            if args.case is None and time.monotonic() - start > args.seconds:
                break
            path, done, fifos, changed = make_case(seed, index, base, work)
            case = os.path.join(work, f"case{index}")
            problems = check_case(path, os.path.join(case, "other"), fifos, changed, args.wait,
                                  cli=index % 4 == 0 or args.case is not None)
            count += 1
            for problem in problems:
                violations += 1
                print(f"VIOLATION seed {seed} case {index} [{'; '.join(done)}]: {problem}", flush=True)
            if args.case is not None:
                print(f"case {index}: {'; '.join(done)}: {len(problems)} violation(s)")
            shutil.rmtree(case, ignore_errors=True)
    print(f"fuzz: seed {seed}, {count} cases in {time.monotonic() - start:.1f} s, {violations} violation(s)",
          flush=True)
    return 1 if violations else 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    os._exit(status)  # a thread a hung case left behind must not keep the process from ending
