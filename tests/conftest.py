"""Shared pytest fixtures."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterator

import pytest
from distributed import RankPool
from s3server import SeaweedS3, weed_runs


@pytest.fixture(scope="session")
def ranks() -> Iterator[Callable[[int], RankPool]]:
    """Factory: ``ranks(n)`` gives a live :class:`RankPool` of ``n`` ranks.

    One pool per world size is kept for the whole session and reused while it is alive; a pool
    torn down by a dead worker, a timeout or a failed health check is replaced by a fresh one.
    All pools are closed at the end of the session.
    """
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        pool = pools.get(world_size)
        if pool is None or not pool.alive:
            if pool is not None:
                pool.close()
            pool = pools[world_size] = RankPool(world_size)
        return pool

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """A SeaweedFS server with an S3 gateway on loopback for the whole session (tests/s3server.py),
    its data in a temp dir, stopped at the end. Skipped only without the s3 extra (boto3) or where
    the ``weed`` binary cannot run; a server that runs but fails to start is an error."""
    pytest.importorskip("boto3", reason="the s3 extra is not installed: pip install 'zerostall[s3]'")
    reason = weed_runs()
    if reason is not None:
        pytest.skip(reason)
    server = SeaweedS3(str(tmp_path_factory.mktemp("seaweedfs")))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> SeaweedS3:
    """The server, with the standard AWS environment variables pointing at it (as a user sets them)."""
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture
def s3_url(s3_env: SeaweedS3, request: pytest.FixtureRequest) -> str:
    """A fresh ``s3://bucket/prefix`` of its own for one test (the environment points at the server)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:60]
    return f"s3://{s3_env.bucket}/{name}-{secrets.token_hex(3)}"
