"""What the README and configs claim stays true to the code."""

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_readme_tables_are_generated_from_the_registry():
    result = subprocess.run([sys.executable, "scripts/gen_readme.py", "--check"], cwd=ROOT, capture_output=True)
    assert result.returncode == 0, result.stderr.decode()


def test_readme_quick_start_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = "bash scripts/setup.sh && .venv/bin/python -m pytest -q"
    assert test_command in readme and test_command in ci


def test_every_config_parses():
    from transformers import HfArgumentParser

    from layerwise_hf import LayerwiseTrainingArguments

    configs = sorted((ROOT / "configs").rglob("*.yaml"))
    assert configs
    for path in configs:
        data = yaml.safe_load(path.read_text())
        assert isinstance(data, dict), path
        assert path.read_text().startswith("#"), f"{path} must start with its launch command"
        if "accelerate" in path.parts:
            from accelerate.commands.config.config_args import load_config_from_file

            config = load_config_from_file(str(path))
            assert config.num_processes >= 1, path
            header = []
            for line in path.read_text().splitlines():
                if not line.startswith("#"):
                    break
                header.append(line)
            assert any("accelerate launch" in h and path.name in h for h in header), f"{path}: no launch command"
            for line in path.read_text().splitlines():
                if ":" in line and not line.lstrip().startswith("#") and not line.rstrip().endswith(":"):
                    assert "#" in line, f"{path}: every key needs a comment: {line!r}"
        if "train" in path.parts:
            fields = {f.name for f in LayerwiseTrainingArguments.__dataclass_fields__.values()}
            args = {k: v for k, v in data.items() if k in fields}
            (parsed,) = HfArgumentParser(LayerwiseTrainingArguments).parse_dict(args, allow_extra_keys=False)
            assert parsed.optim == data.get("optim", parsed.optim)
