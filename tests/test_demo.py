"""The README's demo: killed mid-run, resumed, bit-identical to an uninterrupted run."""

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def test_demo_resumes_bit_exactly(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(DEMO), "--steps", "16", "--every", "5", "--kill-at", "12", "--dir", str(tmp_path / "d")],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from step 10" in proc.stdout
    assert "losses bit-identical: True; final weights bit-identical: True" in proc.stdout
