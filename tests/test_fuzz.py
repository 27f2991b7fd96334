"""The hostile-manifest and corruption fuzzer (tests/fuzz.py), for a few seconds, in a process of
its own with a time limit: a hang fails the test instead of stopping the suite. Every outcome must
be a typed zerostall error or an exact result: zero violations.

``ZEROSTALL_FUZZ_SECONDS`` (default 5) sets how long it runs and ``ZEROSTALL_FUZZ_SEED`` replays a
seed; the seed is printed (``pytest -s`` shows it; a failure report always does). ``.ci/run`` runs
the fuzzer longer on its own.
"""

from __future__ import annotations

import os
import subprocess
import sys


def test_the_fuzzer_finds_no_violation():
    seconds = float(os.environ.get("ZEROSTALL_FUZZ_SECONDS", "5"))
    command = [sys.executable, os.path.join(os.path.dirname(__file__), "fuzz.py"), "--seconds", str(seconds)]
    if os.environ.get("ZEROSTALL_FUZZ_SEED"):
        command += ["--seed", os.environ["ZEROSTALL_FUZZ_SEED"]]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 240)
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        raise AssertionError(f"the fuzzer hung (a case never finished):\n{output[-5000:]}") from None
    print(done.stdout)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and summary.endswith(" 0 violation(s)"), \
        f"{done.stdout[-8000:]}\n{done.stderr[-3000:]}"
    assert " 0 cases" not in summary, summary
