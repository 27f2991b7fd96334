"""A checkpoint with more data files than the process may hold open (one written by hundreds of
ranks, loaded in one process) loads, verifies and reads: readers keep a bounded number of files
open, and memory maps (each holding a descriptor) give way to copies past their budget.

The limit is lowered in a child process, so the test runner's own limit stays as it is.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent('''
    import json, os, resource, sys
    import torch
    import zerostall as zs

    path = sys.argv[1]
    state = {f"t{i}": torch.full((1000,), float(i)) for i in range(300)}
    zs.save(state, path, threads=200)  # 200 data files, as if written by 200 ranks
    files = len([n for n in os.listdir(path) if n.endswith(".safetensors")])
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    report = {"files": files}
    target = {k: torch.zeros(1000) for k in state}
    for step in range(2):  # twice: descriptors of the first load's threads must not pile up
        zs.load(target, path)
    report["loaded"] = all(torch.equal(target[k], state[k]) for k in state)
    report["verified"] = zs.verify(path)
    with zs.open(path) as ck:
        got = [ck.read(f"t{i}") for i in range(300)]
    report["read"] = all(torch.equal(g, state[f"t{i}"]) for i, g in enumerate(got))
    print(json.dumps(report))
''')


def test_more_data_files_than_open_file_descriptors(tmp_path):
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "ck")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"files": 200, "loaded": True, "verified": 300 * 1000 * 4, "read": True}
