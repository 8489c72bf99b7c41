"""examples/galore_layerwise.py runs as a user launches it and shows what transformers' built-in
galore_adamw_layerwise gets wrong next to this plugin's."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("galore_torch")


def test_example_compares_transformers_and_layerwise_hf(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "examples/galore_layerwise.py", "--max_steps", "6", "--output_dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout

    rows = [line.split() for line in out.splitlines() if re.match(r"^\s*\d+\s+\d", line)]
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5, 6]
    logged = [float(r[1]) for r in rows]
    theirs_lr = [float(r[2]) for r in rows]
    ours_lr = [float(r[3]) for r in rows]
    theirs_norm = [float(r[4]) for r in rows]
    ours_norm = [float(r[5]) for r in rows]

    assert len(set(logged)) > 3, "warmup + cosine should move the logged lr"
    # transformers' per-parameter optimizers keep the initial lr; ours apply the scheduled one.
    assert set(theirs_lr) == {1e-2}
    assert ours_lr == logged
    assert theirs_norm == [0.0] * 6 and min(ours_norm) > 0

    assert "logged lr identical in both runs: True" in out
    assert "weight decay applied: transformers=[0.0] layerwise_hf=[0.0, 0.1]" in out
    entries = re.search(
        r"optimizer.pt state entries: transformers=(\d+) layerwise_hf=(\d+) \(trainable tensors: (\d+)\)", out
    )
    assert entries, out
    theirs_entries, ours_entries, trainable = map(int, entries.groups())
    assert theirs_entries == 0 and ours_entries == trainable > 0
    assert (tmp_path / "layerwise_hf" / "checkpoint-6" / "optimizer.pt").is_file()
