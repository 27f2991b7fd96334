"""The client side of :mod:`zerostall.storage.s3`: its options, one boto3 client (and thread pool)
per process and options, request bodies sent from memoryviews, and the error code of a failure."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

MIN_PART = 5 << 20  # S3's smallest part (but the last)


@dataclass(frozen=True)
class S3Options:
    """How to reach an S3-compatible object store (``S3Storage(url, S3Options(...))``); every field
    left None comes from the standard places: environment variables, ``~/.aws/config`` and the profile."""

    endpoint_url: str | None = None
    """The server, e.g. ``http://127.0.0.1:9000`` for MinIO; None: ``AWS_ENDPOINT_URL_S3``,
    ``AWS_ENDPOINT_URL`` or the profile's ``endpoint_url``, else AWS itself."""

    region: str | None = None
    """The region requests are signed for; None: ``AWS_REGION``, ``AWS_DEFAULT_REGION`` or the profile's."""

    profile: str | None = None
    """The AWS config profile to take settings and credentials from; None: ``AWS_PROFILE`` or the default."""

    access_key_id: str | None = None
    """An explicit access key (with ``secret_access_key``); None: the standard credential chain."""

    secret_access_key: str | None = None
    """The secret of ``access_key_id``."""

    session_token: str | None = None
    """A session token for temporary credentials, with the two above."""

    addressing_style: str | None = None
    """"path" (``endpoint/bucket/key``, what most local servers want), "virtual" (``bucket.endpoint``)
    or "auto"; None: the profile's ``s3.addressing_style``, else botocore's choice."""

    part_size: int = 16 << 20
    """Bytes per multipart part of a data file (at least 5 MiB: S3's minimum), and the smallest
    ranged GET a large read is split into; a file may have 10,000 parts, so this also bounds a
    data file's size."""

    concurrency: int = 8
    """Requests in flight per process for part uploads and ranged reads (shared by the files a
    process writes or reads at once)."""

    max_attempts: int = 10
    """Attempts per request before giving up; throttling (503 SlowDown), 5xx answers and broken
    connections are retried with exponential backoff and jitter (botocore's standard retry mode)."""

    connect_timeout: float = 10.0
    """Seconds to open a connection."""

    read_timeout: float = 60.0
    """Seconds a request may wait for the server's next bytes."""

    conditional_writes: bool = True
    """Use ``If-None-Match``/``If-Match`` to create the writer lease and to switch the manifest, so two
    writers cannot both commit; False for a server without them: a read-back check instead, which
    leaves a window of one request between two racing writers."""

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, wanted: str) -> None:
            if not ok:
                raise ValueError(f"S3Options.{name} must be {wanted}, not {getattr(self, name)!r}")

        for name in ("endpoint_url", "region", "profile", "access_key_id", "secret_access_key", "session_token"):
            check(name, getattr(self, name) is None or isinstance(getattr(self, name), str), "None or a str")
        check("addressing_style", self.addressing_style in (None, "auto", "path", "virtual"),
              'None, "auto", "path" or "virtual"')
        for name, least in (("part_size", MIN_PART), ("concurrency", 1), ("max_attempts", 1)):
            value = getattr(self, name)
            check(name, isinstance(value, int) and not isinstance(value, bool) and value >= least, f"an int >= {least}")
        for name in ("connect_timeout", "read_timeout"):
            value = getattr(self, name)
            check(name, isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0, "a number > 0")
        check("conditional_writes", isinstance(self.conditional_writes, bool), "True or False")


class Views:
    """A request body sent view by view (each straight from its memory); iterable again on a retry."""

    def __init__(self, views: list[memoryview]) -> None:
        self.views = views
        self.size = sum(len(v) for v in views)

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[memoryview]:
        return iter(self.views)

    def seek(self, offset: int, whence: int = 0) -> int:
        return 0  # botocore rewinds a body before a retry: iterating again starts over


def runs_of(outs: list[memoryview], offset: int, step: int) -> list[tuple[int, list[memoryview]]]:
    """``outs`` (back to back from file byte ``offset``) cut at the file's multiples of ``step``:
    each run's offset from ``offset`` and the views (or parts of views) it fills."""
    runs: list[tuple[int, list[memoryview]]] = []
    at, room = 0, 0
    for view in outs:
        while len(view):
            if not room:
                runs.append((at, []))
                room = step - (offset + at) % step
            take = min(room, len(view))
            runs[-1][1].append(view[:take])
            view, at, room = view[take:], at + take, room - take
    return runs


class Connection:
    """A boto3 client and the thread pool of part uploads and ranged reads, shared by every
    storage with the same options in this process. The cache holds the few options used last: a
    storage keeps its own connection, and one no storage holds any more is freed (its client's
    sockets closed, its threads ended) instead of piling up with each new set of options (fresh
    credentials)."""

    _cache: dict[tuple[S3Options, int], Connection] = {}  # in order of use, the last used last
    _lock = threading.Lock()
    _KEEP = 4

    def __init__(self, options: S3Options) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise ImportError("s3:// locations need boto3: pip install 'zerostall[s3]'") from exc
        session = boto3.session.Session(profile_name=options.profile, region_name=options.region,
                                        aws_access_key_id=options.access_key_id,
                                        aws_secret_access_key=options.secret_access_key,
                                        aws_session_token=options.session_token)
        s3: dict[str, Any] = {"payload_signing_enabled": False}  # bodies are sent as they are, unhashed
        if options.addressing_style is not None:
            s3["addressing_style"] = options.addressing_style
        config = Config(s3=s3, retries={"mode": "standard", "total_max_attempts": options.max_attempts},
                        connect_timeout=options.connect_timeout, read_timeout=options.read_timeout,
                        max_pool_connections=2 * options.concurrency + 8, parameter_validation=False,
                        request_checksum_calculation="when_required", response_checksum_validation="when_required")
        self.client = session.client("s3", endpoint_url=options.endpoint_url, config=config)
        self.pool = ThreadPoolExecutor(options.concurrency, thread_name_prefix="zerostall-s3")

    @classmethod
    def get(cls, options: S3Options) -> Connection:
        key = (options, os.getpid())  # a forked child makes its own: clients do not survive a fork
        with cls._lock:
            conn = cls._cache.pop(key, None) or cls(options)
            cls._cache[key] = conn
            while len(cls._cache) > cls._KEEP:
                del cls._cache[next(iter(cls._cache))]
            return conn


def error_code(exc: BaseException | None) -> str:
    """The S3 error code of a botocore failure (``NoSuchKey``, ``PreconditionFailed``; else its HTTP
    status), or "" for any other exception."""
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", "")) or str(response.get("ResponseMetadata", {}).get(
        "HTTPStatusCode", ""))


def retried(exc: BaseException | None) -> bool:
    """Whether botocore sent the request of this failure more than once: an earlier attempt whose
    answer was lost may have taken effect."""
    response = getattr(exc, "response", None) or {}
    return bool(response.get("ResponseMetadata", {}).get("RetryAttempts"))
