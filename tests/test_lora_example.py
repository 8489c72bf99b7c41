"""examples/lora_layerwise.py runs as a user would launch it and proves what it prints."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_example(*args, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "examples/lora_layerwise.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_defaults(tmp_path):
    result = run_example("--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    out = result.stdout

    trainable, total, tensors = re.search(
        r"parameters: ([\d,]+) trainable / ([\d,]+) total .*?, (\d+) trainable", out
    ).groups()
    trainable, total = int(trainable.replace(",", "")), int(total.replace(",", ""))
    # r=8 on the 7 linear modules of 2 layers (hidden 128, kv 64, MLP 344): A is r x in, B is out x r.
    shapes = [(128, 128), (128, 64), (128, 64), (128, 128), (128, 344), (128, 344), (344, 128)]
    assert trainable == 2 * sum(8 * (i + o) for i, o in shapes)
    assert trainable < 0.1 * total and int(tensors) == 28

    assert "adamw_torch_layerwise, 28 per-parameter optimizers, all on LoRA adapters" in out
    measured, estimated = re.search(r"optimizer state: (.+?) measured \(estimate (.+?)\)", out).groups()
    assert measured == estimated
    assert int(re.search(r"would hold .+? \((\d+)x more\)", out).group(1)) >= 5
    first, last = map(float, re.search(r"loss: ([\d.]+) -> ([\d.]+) over 30 steps", out).groups())
    assert last < first
    assert "base weights unchanged: yes (21 frozen tensors" in out
    assert "adapters trained: yes" in out


def test_8bit_on_attention_only(tmp_path):
    result = run_example(
        "--optim", "adamw_8bit_layerwise", "--lora_target_modules", "q_proj", "v_proj", "--max_steps", "3",
        "--output_dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "adamw_8bit_layerwise, 8 per-parameter optimizers, all on LoRA adapters" in result.stdout
    assert "base weights unchanged: yes" in result.stdout


def test_standard_optimizer_is_refused(capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import lora_layerwise
    finally:
        sys.path.remove(str(ROOT / "examples"))
    with pytest.raises(SystemExit) as exc:
        lora_layerwise.main(["--optim", "adamw_torch"])
    assert exc.value.code == 2
    assert "_layerwise" in capsys.readouterr().err
