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


def _doc_texts():
    docs = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {path.relative_to(ROOT): path.read_text() for path in docs}


def test_every_module_path_the_docs_name_exists():
    import importlib
    import re

    missing = []
    for doc, text in _doc_texts().items():
        for path in set(re.findall(r"layerwise_hf/[\w/]+\.py", text)):
            if not (ROOT / path).is_file():
                missing.append(f"{doc}: {path}")
        for dotted in set(re.findall(r"`(layerwise_hf(?:\.\w+)+)", text)):
            parts, obj = dotted.split("."), None
            # The longest importable prefix, then attributes (a class, a function, a constant).
            for k in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:k]))
                except ImportError:
                    continue
                try:
                    for attr in parts[k:]:
                        obj = getattr(obj, attr)
                except AttributeError:
                    obj = None
                break
            if obj is None:
                missing.append(f"{doc}: {dotted}")
    assert not missing, missing


def test_architecture_table_names_every_module_where_it_lives():
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("## The parts") : text.index("## The path of one gradient")]
    named, folder = set(), ""
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) < 4 or not row.startswith("|") or (cells[0] and set(cells[0]) <= set("-")):
            continue
        if cells[0].startswith("`") and cells[0].endswith("/`"):
            folder = cells[0].strip("`")
        elif cells[0] == "(top)":
            folder = ""
        for module in re.findall(r"`(\w+\.py)`", cells[1]):
            named.add(f"{folder}{module}")
    package = ROOT / "layerwise_hf"
    actual = {
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if p.name != "__init__.py" and not str(p.relative_to(package)).startswith(("estimate/", "training_args.py"))
    } | {"__init__.py"}
    assert named == actual, (sorted(named - actual), sorted(actual - named))
