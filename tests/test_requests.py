"""What the command line costs in S3 requests, counted as the server sees them (the real SeaweedFS
server behind a proxy that records every request): a checkpoint's manifest is read once per command,
nothing is listed before it for a checkpoint of ours, file sizes come from one listing, a
safetensors header takes one read, and ``import`` reads each source value once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import save_file

import zerostall as zs
from s3proxy import FaultProxy
from s3server import SeaweedS3
from zerostall.cli import cli
from zerostall.format.layout import MANIFEST_NAME
from zerostall.storage import storage_for
from zerostall.storage.s3client import Connection


@dataclass(frozen=True)
class Request:
    """One S3 request: its method, the key (or, for a listing, the prefix) and its query and range."""

    method: str
    key: str
    query: dict[str, list[str]]
    range: tuple[int, int] | None

    @property
    def listing(self) -> bool:
        return self.method == "GET" and ("list-type" in self.query or "uploads" in self.query)


class Requests(list[Request]):
    """The requests seen since the last :meth:`clear`."""

    def gets(self, key: str) -> list[Request]:
        return [r for r in self if r.method == "GET" and r.key == key and not r.listing]

    def heads(self) -> list[Request]:
        return [r for r in self if r.method == "HEAD"]

    def listings(self, prefix: str) -> list[Request]:
        return [r for r in self if r.listing and r.query.get("prefix", [""])[0] == prefix]


@pytest.fixture
def requests(s3_env: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[Requests]:
    """Every S3 request of this test, through a proxy that records them (it injects no fault)."""
    seen = Requests()

    def record(method: str, path: str, headers: object) -> bool:
        url = urlsplit(path)
        key = unquote(url.path).removeprefix(f"/{s3_env.bucket}").removeprefix("/")
        query = parse_qs(url.query, keep_blank_values=True)
        ranged = headers.get("Range")  # type: ignore[attr-defined]
        span = tuple(map(int, ranged.removeprefix("bytes=").split("-"))) if ranged else None
        seen.append(Request(method, key, query, (span[0], span[1] + 1) if span else None))
        return False

    with FaultProxy(s3_env.endpoint, every=1, when=record) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setattr(Connection, "_cache", {})  # clients made from now on go through the proxy
        yield seen


def key_of(url: str, name: str = "") -> str:
    """The object key of ``name`` under ``url`` (its prefix, with ``name`` empty)."""
    return storage_for(url).prefix + name  # type: ignore[attr-defined]


def run(*args: object) -> Result:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code in (0, 1), result.output
    return result


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(1000 * (i + 1), generator=g) for i in range(4)}


@pytest.fixture
def saved(s3_url: str) -> tuple[str, str]:
    """Two equal checkpoints on S3, of two data files each."""
    for name in ("a", "b"):
        zs.save(state(0), f"{s3_url}/{name}", threads=2)
    return f"{s3_url}/a", f"{s3_url}/b"


def test_inspect_reads_the_manifest_once_and_lists_nothing(saved: tuple[str, str], requests: Requests) -> None:
    a, _ = saved
    requests.clear()
    run("inspect", a)
    assert [(r.method, r.key) for r in requests] == [("GET", key_of(a, MANIFEST_NAME))]


def test_diff_reads_each_manifest_once_and_lists_nothing(saved: tuple[str, str], requests: Requests) -> None:
    a, b = saved
    requests.clear()
    assert run("diff", a, b).exit_code == 0
    assert len(requests.gets(key_of(a, MANIFEST_NAME))) == len(requests.gets(key_of(b, MANIFEST_NAME))) == 1
    assert not [r for r in requests if r.listing]


def test_cp_reads_the_manifest_once_and_sizes_the_files_from_one_listing(saved: tuple[str, str], requests: Requests,
                                                                        tmp_path: Path) -> None:
    a, _ = saved
    requests.clear()
    run("cp", a, tmp_path / "c")
    assert len(requests.gets(key_of(a, MANIFEST_NAME))) == 1
    assert not requests.heads() and len(requests.listings(key_of(a))) == 1
    assert zs.verify(tmp_path / "c") > 0


def test_cp_lists_the_destination_once_and_sizes_the_files_there_from_that_listing(
        saved: tuple[str, str], requests: Requests, tmp_path: Path, s3_url: str) -> None:
    a, _ = saved
    d = f"{s3_url}/d"
    zs.copy(a, tmp_path / "c")
    requests.clear()
    run("cp", tmp_path / "c", d)
    first_write = next(i for i, r in enumerate(requests) if r.method == "PUT")
    assert len(Requests(requests[:first_write]).listings(key_of(d))) == 1
    requests.clear()
    again = run("cp", tmp_path / "c", d, "--overwrite", "--json")  # every file is complete there: kept
    assert '"skipped_files": 2' in again.output
    assert [r.key for r in requests.heads()] == [key_of(d, MANIFEST_NAME)]  # the commit's look; no file sized alone
    assert zs.verify(d) > 0


def test_import_reads_each_header_in_one_request_and_each_value_once(s3_url: str, requests: Requests,
                                                                     tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    source = storage_for(f"{s3_url}/hf")
    sizes = {}
    for n in range(2):
        name = f"part-{n + 1}.safetensors"  # safetensors files side by side (shards would need their index)
        save_file({f"layer{n}.w{i}": torch.randn(100_000, generator=g) for i in range(3)}, tmp_path / name)
        data = (tmp_path / name).read_bytes()
        source.write(name, [memoryview(data)])
        sizes[name] = len(data), 8 + int.from_bytes(data[:8], "little")  # its size and its header's end
    requests.clear()
    report = run("import", f"{s3_url}/hf", tmp_path / "imported", "--json")
    assert report.exit_code == 0, report.output
    for name, (size, header_end) in sizes.items():
        reads = sorted(r.range for r in requests.gets(key_of(f"{s3_url}/hf", name)) if r.range)
        header, values = reads[0], reads[1:]
        assert header[0] == 0 and header[1] >= header_end, reads  # the header: one request
        assert all(lo >= header_end for lo, _ in values), reads
        assert all(x[1] <= y[0] for x, y in zip(values, values[1:])), reads  # no value's bytes asked for twice
        assert values[-1][1] == size, reads
    assert not requests.heads()  # the files' sizes come from one listing


def test_export_reads_the_manifest_once_and_lists_nothing(saved: tuple[str, str], requests: Requests,
                                                          tmp_path: Path) -> None:
    a, _ = saved
    requests.clear()
    assert run("export", a, tmp_path / "hf").exit_code == 0
    assert requests[0].key == key_of(a, MANIFEST_NAME) and len(requests.gets(key_of(a, MANIFEST_NAME))) == 1
    assert all(r.method == "GET" and r.key.endswith(".safetensors") and r.range for r in requests[1:]), requests
    got, want = zs.load(state(1), tmp_path / "hf"), state(0)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
