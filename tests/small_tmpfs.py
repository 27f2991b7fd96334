"""Commands that run with a small tmpfs mounted at a directory, in a private mount namespace (as
root ``unshare -m``; otherwise ``unshare -rm``, in a user namespace too): a file system that really
fills up, for the tests of a full disk and of a small ``/dev/shm``."""

from __future__ import annotations

import os
import shutil
import subprocess


def in_small_tmpfs(mountpoint: str, size: str, *command: str) -> list[str]:
    """The command line that runs ``command`` with a ``size`` tmpfs (``"16m"``) on ``mountpoint``."""
    script = f'mount -t tmpfs -o size={size} zerostall-test "$1" && shift && exec "$@"'
    return ["unshare", "-m" if os.geteuid() == 0 else "-rm", "sh", "-c", script, "sh", mountpoint, *command]


def unavailable(mountpoint: str) -> str | None:
    """Why no small tmpfs can be mounted on ``mountpoint`` here (a reason to skip), or None."""
    if shutil.which("unshare") is None:
        return "needs unshare(1) to mount a small tmpfs in a private mount namespace"
    probe = subprocess.run(in_small_tmpfs(mountpoint, "1m", "true"), capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return f"needs a private mount namespace to mount a small tmpfs (unshare: {probe.stderr.strip()})"
    return None
