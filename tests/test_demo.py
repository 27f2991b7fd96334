"""The README's demo: 2 FSDP2 ranks, asynchronous checkpoints, killed, resumed bit-identically."""

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def test_demo_resumes_bit_exactly(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(DEMO), "--steps", "14", "--every", "4", "--kill-at", "10", "--dir", str(tmp_path / "d")],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "killed after step 10" in proc.stdout
    assert "losses bit-identical: True; final weights bit-identical: True" in proc.stdout
