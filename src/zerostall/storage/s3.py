"""S3 and S3-compatible object stores (AWS, MinIO, Ceph, SeaweedFS) through boto3 (``zerostall[s3]``).

A location is ``s3://bucket/prefix``; a file is the object ``prefix/name``. Data files are
multipart uploads of part-sized runs of the writer's memoryviews (no copy: each part is sent from
tensor memory as it is), ``If-None-Match: *`` on completion, aborted if anything fails; reads are
ranged GETs straight into the caller's buffers, a large one split over parallel requests. The
commit switch is a conditional PUT (``If-Match`` the ETag seen before the last check), so of two
writers racing on one manifest one fails. Endpoint, region and credentials come from the usual
places (environment, AWS config and profile) unless :class:`S3Options` names them.
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterable

from ..errors import ConcurrentWriteError, StorageError
from ..format.layout import MANIFEST_NAME
from .base import FileStat, Storage, check_name
from .s3client import Connection, S3Options, Views, error_code, retried
from .s3reads import S3Reads

log = logging.getLogger(__name__)

_MAX_PARTS = 10_000
_DELETE_BATCH = 1000  # keys per DeleteObjects request
_CONFLICT = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")  # a condition did not hold


def _holds(landed: Callable[[], bool], where: str, doing: str) -> bool:
    """Whether an earlier attempt of a write took effect (``landed()``), an absent object being a
    no; a look-up that fails leaves the outcome unknown: a :class:`StorageError` says so, since a
    conflict reported then could make the caller delete what that attempt committed."""
    try:
        return landed()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise StorageError(f"{doing} {where}: the outcome is unknown. An attempt may have taken effect (its answer "
                           f"was lost), and looking that up failed ({exc}); read {where} again once the store "
                           "answers") from exc


class S3Storage(S3Reads, Storage):
    """The objects under ``s3://bucket/prefix``. Picklable (as its URL and options), so a writer
    process reaches the same place."""

    remote = True

    def __init__(self, url: str, options: S3Options | None = None) -> None:
        bucket, _, prefix = url[5:].partition("/") if url.startswith("s3://") else ("", "", "")
        prefix = prefix.strip("/")
        if not bucket or prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
            raise ValueError(f"an S3 location is s3://bucket[/prefix], a prefix of plain names (no empty, '.' or '..' "
                             f"part, which other tools resolve differently), not {url!r}")
        self.options = options or S3Options()
        self.requests_in_flight = self.options.concurrency
        self.read_grid = self.options.part_size  # data files are uploaded in parts of this size
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        self.location = f"s3://{self.bucket}/{prefix}".rstrip("/")
        self._conn = Connection.get(self.options)

    def __getstate__(self) -> dict[str, object]:
        return {"location": self.location, "options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["location"], state["options"])

    @property
    def _client(self) -> Any:
        return self._conn.client

    def _key(self, name: str) -> str:
        """The key of file ``name``, a plain name (else ``UnsafeFileError``): nothing outside the prefix."""
        return self.prefix + check_name(name)

    def _prefix(self, path: str) -> str:
        """The key prefix of sub-location ``path`` (names joined by ``/``)."""
        return f"{self.prefix}{path.strip('/')}/"

    def _error(self, exc: Exception, key: str, doing: str) -> OSError:
        """The OSError for a failed request on ``key``: FileNotFoundError for an absent object."""
        code, where = error_code(exc), f"s3://{self.bucket}/{key}"
        if code in ("404", "NoSuchKey", "NotFound"):
            return FileNotFoundError(2, f"no object {where}", where)
        return StorageError(f"{doing} {where} failed: {exc}" + (
            "; the server may not support conditional writes: pass S3Options(conditional_writes=False)"
            if code in ("501", "NotImplemented") else ""))

    def _call(self, key: str, doing: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """``fn(Bucket=..., **kwargs)``, its failure an OSError naming ``key`` (see :meth:`_error`).
        An answer whose body breaks off while botocore reads it whole (it retries only requests
        that fail before an answer) is asked for again, as botocore would."""
        from botocore.exceptions import BotoCoreError, ClientError
        from urllib3.exceptions import HTTPError

        attempt = 0
        while True:
            try:
                return fn(Bucket=self.bucket, **kwargs)
            except (ClientError, BotoCoreError) as exc:
                raise self._error(exc, key, doing) from exc
            except HTTPError as exc:
                attempt += 1
                self._again_or_fail(f"{doing} s3://{self.bucket}/{key}", attempt, exc)

    def _again_or_fail(self, what: str, attempt: int, exc: BaseException) -> None:
        """After a connection that broke mid-answer: wait to ask again (full jitter, as botocore),
        or raise :class:`StorageError` after ``max_attempts``."""
        if attempt >= self.options.max_attempts:
            raise StorageError(f"{what} failed: {exc}") from exc
        time.sleep(random.uniform(0, min(20.0, 0.1 * 2 ** attempt)))

    def _pages(self, prefix: str, delimiter: str = "", what: str = "list_objects_v2") -> list[dict[str, Any]]:
        """Every page of a listing of ``prefix`` (1000 entries a page): objects, or multipart uploads."""
        def listing(Bucket: str) -> list[dict[str, Any]]:  # the keyword _call passes
            return list(self._client.get_paginator(what).paginate(Bucket=Bucket, Prefix=prefix, Delimiter=delimiter))

        return self._call(prefix, "listing", listing)

    # -- the location --------------------------------------------------------------------------
    def create(self) -> None:
        """Nothing to make: an object store has no directories (a location exists once it holds an object)."""

    def exists(self) -> bool:
        """Whether an object (not a folder marker) lies under the prefix; the bucket, for its root."""
        if not self.prefix:
            try:
                self._call("", "looking up the bucket", self._client.head_bucket)
            except FileNotFoundError:
                return False
            return True
        page = self._call(self.prefix, "listing", self._client.list_objects_v2, Prefix=self.prefix)
        return any(not o["Key"].endswith("/") for o in page.get("Contents", ()))  # markers are few: one page

    def list(self) -> list[str]:
        """The objects directly under the prefix; folder markers (keys ending in "/", as consoles
        and some servers make for an emptied folder) are not files."""
        return sorted(self.sizes())

    def sizes(self) -> dict[str, int]:
        skip = len(self.prefix)
        return {o["Key"][skip:]: o["Size"] for page in self._pages(self.prefix, "/") for o in page.get("Contents", ())
                if not o["Key"].endswith("/")}

    def child(self, name: str) -> S3Storage:
        return S3Storage(f"{self.location}/{name.strip('/')}", self.options)

    def parent(self) -> S3Storage:
        return S3Storage(self.location.rsplit("/", 1)[0] if self.prefix else self.location, self.options)

    def children(self) -> list[str]:
        skip = len(self.prefix)
        return sorted(p["Prefix"][skip:].rstrip("/") for page in self._pages(self.prefix, "/")
                      for p in page.get("CommonPrefixes", ()))

    def size(self, name: str) -> int:
        return self.stat(name).size

    def _head(self, name: str) -> dict[str, Any]:
        return self._call(self._key(name), "looking up", self._client.head_object, Key=self._key(name))

    def stat(self, name: str) -> FileStat:
        head = self._head(name)
        modified = head["LastModified"].timestamp()
        return FileStat(head["ContentLength"], modified, f"{head['ETag']}:{modified}")

    # -- writing -------------------------------------------------------------------------------
    def write(self, name: str, parts: Iterable[memoryview]) -> int:
        """A multipart upload of ``part_size`` runs of ``parts`` (one plain PUT if they are fewer),
        uploaded in parallel as the writer produces (and hashes) the next ones; aborted on failure."""
        key, step = self._key(name), self.options.part_size
        upload: str | None = None
        pending: list[Future[dict[str, Any]]] = []
        batch: list[memoryview] = []
        filled = written = settled = 0  # settled: parts known to be done, in order
        try:
            for view in parts:
                while len(view):
                    take = min(len(view), step - filled)
                    batch.append(view[:take])
                    filled, written, view = filled + take, written + take, view[take:]
                    if filled < step:
                        continue
                    if upload is None:
                        upload = self._call(key, "starting the upload of", self._client.create_multipart_upload,
                                            Key=key)["UploadId"]
                    pending.append(self._submit_part(name, upload, len(pending) + 1, batch))
                    batch, filled = [], 0
                    while len(pending) - settled > self.options.concurrency:  # bound the parts queued
                        pending[settled].result()
                        settled += 1
            if upload is None:
                self._put(name, batch, exclusive=True)
                return written
            if batch:
                pending.append(self._submit_part(name, upload, len(pending) + 1, batch))
            done = [f.result() for f in pending]

            def landed() -> bool:  # the object a completion makes: this size, an ETag of this many parts
                head = self._head(name)
                return head["ContentLength"] == written and head["ETag"].strip('"').endswith(f"-{len(done)}")

            self._conditional(key, "completing the upload of", self._client.complete_multipart_upload, True, landed,
                              Key=key, UploadId=upload, MultipartUpload={"Parts": done})
        except BaseException:
            for f in pending:
                f.cancel()
            for f in pending:
                if not f.cancelled():
                    f.exception()  # wait: no part may land after the abort
            if upload is not None:
                self._abort(key, upload)
            raise
        return written

    def _submit_part(self, name: str, upload: str, number: int, views: list[memoryview]) -> Future[dict[str, Any]]:
        if number > _MAX_PARTS:
            raise StorageError(f"{self.location}/{name} would need more than {_MAX_PARTS} parts of "
                               f"{self.options.part_size} bytes: raise S3Options.part_size")

        def send() -> dict[str, Any]:
            answer = self._call(self._key(name), "uploading a part of", self._client.upload_part, Key=self._key(name),
                                UploadId=upload, PartNumber=number, Body=Views(views))
            return {"PartNumber": number, "ETag": answer["ETag"]}

        return self._conn.pool.submit(send)

    def _abort(self, key: str, upload: str) -> None:
        try:
            self._call(key, "aborting the upload of", self._client.abort_multipart_upload, Key=key, UploadId=upload)
        except OSError as exc:
            log.warning("could not abort the multipart upload of s3://%s/%s (%s): its parts stay until a clean-up",
                        self.bucket, key, exc)

    def _put(self, name: str, views: list[memoryview], *, exclusive: bool = False, if_match: str | None = None) -> None:
        kwargs: dict[str, Any] = {"Key": self._key(name), "Body": Views(views)}
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        self._conditional(self._key(name), "writing", self._client.put_object, exclusive,
                          lambda: self._fetch(name, None) == b"".join(views), **kwargs)

    def _conditional(self, key: str, doing: str, fn: Callable[..., Any], exclusive: bool,
                     landed: Callable[[], bool] | None = None, **kwargs: Any) -> Any:
        """``fn`` with ``If-None-Match: *`` when ``exclusive`` (and conditional writes are on);
        a failed condition is a :class:`ConcurrentWriteError`, unless the request was sent again
        and ``landed()`` says the object is what this write makes: an earlier attempt took effect
        and its answer was lost (a completed upload is then gone: the retry fails as well)."""
        conditional = self.options.conditional_writes and (exclusive or "IfMatch" in kwargs)
        if exclusive and self.options.conditional_writes:
            kwargs["IfNoneMatch"] = "*"
        elif not self.options.conditional_writes:
            kwargs.pop("IfMatch", None)
        try:
            return self._call(key, doing, fn, **kwargs)
        except StorageError as exc:
            lost = retried(exc.__cause__) and error_code(exc.__cause__) in (*_CONFLICT, "NoSuchUpload")
            if lost and landed is not None and _holds(landed, f"s3://{self.bucket}/{key}", doing):
                log.info("%s s3://%s/%s: an earlier attempt took effect, its answer was lost", doing, self.bucket, key)
                return None
            if conditional and error_code(exc.__cause__) in _CONFLICT:
                raise ConcurrentWriteError(f"s3://{self.bucket}/{key} was written by another writer meanwhile; "
                                           "this write did not take effect") from exc
            raise

    def publish(self, name: str, tmp_name: str, data: bytes,
                before_replace: Callable[[], None] | None = None) -> None:
        """One PUT (atomic on an object store: no temp object). With ``before_replace``: the ETag in
        place is read first, then the check runs, then the PUT is conditional on that ETag (or on
        there being none), so a writer that switched meanwhile makes this one fail."""
        if before_replace is None:
            self._put(name, [memoryview(data)])
            return
        try:
            etag: str | None = self._head(name)["ETag"]
        except FileNotFoundError:
            etag = None
        before_replace()
        self._put(name, [memoryview(data)], exclusive=etag is None, if_match=etag)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """``If-None-Match: *``; without conditional writes, a look first and a read back after."""
        if not self.options.conditional_writes:
            try:
                self.stat(name)
                return False
            except FileNotFoundError:
                self._put(name, [memoryview(data)])
            return self.read_bytes(name) == data
        try:
            self._put(name, [memoryview(data)], exclusive=True)
        except ConcurrentWriteError:
            return False
        return True

    def delete(self, name: str) -> None:
        self._call(self._key(name), "deleting", self._client.delete_object, Key=self._key(name))

    def delete_tree(self, name: str) -> None:
        """Every object under ``name/`` (in batches), and the multipart uploads left there."""
        prefix = self._prefix(name)
        keys = [o["Key"] for page in self._pages(prefix) for o in page.get("Contents", ())]
        for lo in range(0, len(keys), _DELETE_BATCH):
            batch = {"Objects": [{"Key": k} for k in keys[lo:lo + _DELETE_BATCH]], "Quiet": True}
            errors = self._call(prefix, "deleting objects under", self._client.delete_objects, Delete=batch).get("Errors")
            if errors:
                log.warning("could not delete %d objects under s3://%s/%s: %s", len(errors), self.bucket, prefix,
                            errors[0])
        self.abort_uploads(name)

    def abort_uploads(self, name: str = "", which: Callable[[str], bool] | None = None) -> int:
        """Abort the unfinished multipart uploads under ``name/`` (all of the location's by default);
        with ``which``, only those whose keys (relative to ``name/``, ``a/b`` for one deeper) it accepts."""
        prefix = self._prefix(name) if name else self.prefix
        uploads = [(u["Key"], u["UploadId"]) for page in self._pages(prefix, "", "list_multipart_uploads")
                   for u in page.get("Uploads", ()) if which is None or which(u["Key"][len(prefix):])]
        for key, upload in uploads:
            self._abort(key, upload)
        return len(uploads)

    def move(self, src: str, dst: str) -> None:
        """Copy every object, a manifest last, then delete them, a manifest first: neither place
        ever holds a manifest without its data files. Uploads still open under ``src`` are aborted
        first, so a writer still writing there fails to complete its files."""
        self.abort_uploads(src)
        src_prefix, dst_prefix = self._prefix(src), self._prefix(dst)
        keys = [o["Key"] for page in self._pages(src_prefix) for o in page.get("Contents", ())]
        if not keys:
            raise FileNotFoundError(2, f"nothing under {self.location}/{src} to move", f"{self.location}/{src}")
        keys.sort(key=lambda k: k.endswith(f"/{MANIFEST_NAME}"))
        for key in keys:
            target = dst_prefix + key[len(src_prefix):]
            self._call(key, "copying", self._client.copy, CopySource={"Bucket": self.bucket, "Key": key}, Key=target)
        for key in reversed(keys):
            self._call(key, "deleting", self._client.delete_object, Key=key)
