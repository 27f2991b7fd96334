"""Build DeepSpeed's just-in-time ops the tests use (its shared-memory communication, asynchronous
I/O for NVMe offload, pinned memory) once, into torch's extension cache (``TORCH_EXTENSIONS_DIR``,
by default ~/.cache/torch_extensions), so that no test waits minutes for a compiler. An op that
cannot be built here (no compiler, no libaio-dev for asynchronous I/O) is named, and the tests
that need it skip."""

from __future__ import annotations

import glob
import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

OPS = ["ShareMemCommBuilder", "AsyncIOBuilder", "PinMemoryBuilder"]
STALE_LOCK_S = 30 * 60
"""A build directory's ``lock`` older than this was left by a build that was killed (these ops
build in minutes): torch's next build of that op would wait on it for ever."""


def remove_stale_locks(now: float | None = None) -> list[str]:
    """Remove the locks that killed builds left in torch's extension cache; the paths removed."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    removed = []
    for lock in glob.glob(os.path.join(root, "*", "lock")) + glob.glob(os.path.join(root, "*", "*", "lock")):
        age = (time.time() if now is None else now) - os.path.getmtime(lock)
        if age > STALE_LOCK_S:
            print(f"removing {lock}: left by a build killed {age / 60:.0f} minutes ago (later builds would wait on it)")
            os.remove(lock)
            removed.append(lock)
    return removed


def main() -> int:
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        print("deepspeed is not installed: nothing to build")
        return 0
    remove_stale_locks()
    for name in OPS:
        start = time.perf_counter()
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"deepspeed op {name}: cannot be built here (for AsyncIOBuilder: apt-get install libaio-dev); "
                  "the tests that need it skip")
            continue
        try:
            builder.load(verbose=False)
        except Exception as exc:  # a compiler error: say it, the tests that need the op skip or fail by name
            print(f"deepspeed op {name}: build failed: {exc}")
            continue
        print(f"deepspeed op {name}: ready ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
