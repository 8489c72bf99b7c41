"""What the README, the guides in docs/ and the configs claim stays true to the code."""

import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PINS = dict(
    line.split("==") for line in (ROOT / "ci" / "default.txt").read_text().splitlines() if "==" in line
)


@pytest.mark.skipif(
    version("transformers") != DEFAULT_PINS["transformers"],
    reason="the tables list the optimizer names of the default combination's transformers (ci/default.txt)",
)
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


GUIDES = sorted(p.name for p in (ROOT / "docs").glob("*.md"))


def _slug(heading: str) -> str:
    # GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces to hyphens.
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_in_the_docs_resolves():
    # Text moved between the README and the guides: a link to a file or a heading that moved elsewhere fails here.
    broken = []
    for doc, text in _doc_texts().items():
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (ROOT / doc).parent / path if path else ROOT / doc
            if not file.exists():
                broken.append(f"{doc}: {target}")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", file.read_text(), flags=re.S), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{doc}: {target} (no such heading)")
    assert not broken, broken


def test_readme_links_every_guide_and_each_guide_says_what_it_answers():
    readme = (ROOT / "README.md").read_text()
    assert {"architecture.md", "benchmarks.md", "distributed.md", "optimizers.md", "sizing.md"} <= set(GUIDES)
    for name in GUIDES:
        assert f"](docs/{name})" in readme, f"README.md does not link docs/{name}"
        if name == "architecture.md":
            continue  # a map of the code, not a guide to one question
        text = (ROOT / "docs" / name).read_text()
        title, first = text.split("\n\n")[:2]
        assert title.startswith("# "), name
        # One sentence: it ends the paragraph and is the paragraph's only full stop.
        sentence = " ".join(first.split())
        assert sentence.startswith("This guide answers ") and sentence.endswith("."), (name, sentence)
        assert sentence.count(". ") == 0, (name, sentence)


def test_readme_stays_a_front_page():
    # What moved to the guides stays there: the README keeps the quick start, the support table, the limits, links.
    readme = (ROOT / "README.md").read_text()
    headings = set(re.findall(r"^## (.+)$", readme, re.M))
    assert {"Quick start", "What is supported", "Limitations", "Guides", "Development"} <= headings
    moved = {
        "TRL",
        "Distributed",
        "Gradient clipping (`layerwise_clip`)",
        "Checkpoints",
        "Reliability",
        "Memory",
        "Fitting a large model",
        "Supported optimizers",
        "Compared with transformers' built-in layer-wise path",
        "Precision",
    }
    assert not headings & moved, f"{sorted(headings & moved)} have a guide in docs/"
    assert "<!--" not in readme, "generated tables live in the guides"


def test_sizing_guide_tables_are_what_the_estimator_prints(capsys):
    # The worked examples quote `layerwise-hf estimate-memory`: each command in the guide, run, prints the rows the
    # guide's table under it shows (the optimizer cell may add a note in parentheses).
    import shlex

    from layerwise_hf.cli import main

    text = (ROOT / "docs" / "sizing.md").read_text()
    examples = re.findall(r"```bash\n(layerwise-hf estimate-memory [^`]*)```\n\n((?:\|.*\n)+)", text)
    assert len(examples) == 2
    for command, table in examples:
        argv = shlex.split(command.replace("\\\n", " "))[1:]
        assert main(argv) == 0, command
        printed = [
            [cell.strip() for cell in line.strip("│").split("│")]
            for line in capsys.readouterr().out.splitlines()
            if line.startswith("│") and line.count("│") > 3
        ][1:]  # the header row
        quoted = [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in table.splitlines()[2:]]
        quoted = [[re.sub(r"^`(\w+)`.*$", r"\1", cell) for cell in row] for row in quoted]
        assert quoted == printed, command


def test_readme_offload_figures_are_the_generated_plans():
    # The README's short offload table quotes the planner's generated table in the offload guide: every size it
    # gives must be one the guide's generated section shows, so a regenerated plan cannot leave it behind.
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## When host offload pays", 1)[1].split("\n## ", 1)[0]
    guide = (ROOT / "docs" / "offload.md").read_text()
    generated = guide.split("<!-- plan-8b-offload:start -->", 1)[1].split("<!-- plan-8b-offload:end -->", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    quoted = re.findall(r"\d+\.\d\d", table) + re.findall(r"\d+\.\d\d [MG]iB", section)
    assert len(quoted) >= 20
    assert not [q for q in quoted if q not in generated]


# ---------------------------------------------------------------- scripts/setup.sh: the CPU build of torch

_STUB_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../../pip.log"
case "$*" in
  *"torch==2.13.0+cpu"*) [ "${LOCAL_CPU_WHEEL:-0}" = 1 ] || exit 1 ;;
esac
exit 0
"""


@pytest.mark.parametrize("local", [True, False], ids=["local-wheel-store", "cpu-index"])
def test_setup_script_installs_the_cpu_build_of_torch(tmp_path, local):
    # scripts/setup.sh with a stand-in .venv/bin/python that logs every pip command: where pip's own sources have no
    # CPU build, torch comes from PyTorch's CPU index, never as a plain `torch==2.13.0` from PyPI (a CUDA build).
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_text((ROOT / "scripts" / "setup.sh").read_text())
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(_STUB_PYTHON)
    python.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "LOCAL_CPU_WHEEL": "1" if local else "0"}
    result = subprocess.run(["bash", "scripts/setup.sh"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    torch_installs = [line for line in (tmp_path / "pip.log").read_text().splitlines() if "torch==" in line]
    cpu_index = "-m pip install --quiet --index-url https://download.pytorch.org/whl/cpu torch==2.13.0"
    assert torch_installs == ["-m pip install --quiet torch==2.13.0+cpu"] + ([] if local else [cpu_index])
    said = "from pip's configured sources" if local else "installing torch 2.13.0 from https://download.pytorch.org"
    assert said in result.stdout


def test_setup_script_ends_by_refusing_a_cuda_build():
    script = (ROOT / "scripts" / "setup.sh").read_text()
    assert "assert torch.version.cuda is None" in script.splitlines()[-1]


# ---------------------------------------------------------------- one install command, everywhere

_INSTALL = re.compile(r"pip install (?:-\S+ )*(\"[^\"]+\"|[^\s`)]+)")


def _plugin_installs():
    """Every `pip install` of this package in the README, the guides and the example configs: (file, line, target)."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("*.yaml"))]
    for path in files:
        for line in path.read_text().splitlines():
            for target in _INSTALL.findall(line):
                target = target.strip("`\"'")
                if target.startswith((".", "layerwise")) or "layerwise-hf" in target:
                    yield path.relative_to(ROOT), line, target


def test_the_plugin_installs_one_way_everywhere():
    # Not on PyPI yet: `pip install .` (extras `".[x]"`) in the clone; `layerwise-hf` only where the text says what
    # changes once it is published.
    installs = list(_plugin_installs())
    assert {str(path) for path, _, _ in installs} >= {"README.md", "docs/frameworks.md", "docs/usage.md"}
    for path, line, target in installs:
        if target.startswith("layerwise-hf"):
            assert "once" in line.lower() or "published" in line.lower(), f"{path}: {line}"
        else:
            assert re.fullmatch(r"\.(\[[a-z,]+\])?", target), f"{path}: {line}"
    header = (ROOT / "examples" / "frameworks" / "axolotl.yaml").read_text().split("base_model")[0]
    assert "`pip install .` in a clone of layerwise_hf" in header


@pytest.mark.slow
def test_the_documented_install_command_resolves_to_this_package(tmp_path):
    # What `pip install ".[bnb]"` does in a clone, without changing this environment.
    import shutil

    clone = tmp_path / "layerwise_hf"
    shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(".venv*", ".git", "build", "*.egg-info", "__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", ".[bnb]"],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Would install layerwise-hf-0.1.0" in result.stdout
