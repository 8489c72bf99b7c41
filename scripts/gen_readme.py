"""Regenerate the generated sections of README.md from the code, so they cannot drift.

python scripts/gen_readme.py          # rewrite README.md
python scripts/gen_readme.py --check  # exit 1 if README.md is stale (the test suite runs this)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def optimizer_table() -> str:
    from layerwise_hf.registry import _REFUSED_BASES, TRANSFORMERS_LAYERWISE_NAMES, describe_layerwise_optimizers

    lines = ["| `optim=` | Trainer base it resolves | extra package |", "|---|---|---|"]
    lines += [f"| `{name}` | `{base}` | {package or '-'} |" for name, base, package in describe_layerwise_optimizers()]
    lines += ["", "Refused (not per-tensor), with the reason the error gives:", ""]
    lines += [f"- `{base}_layerwise`: {why}" for base, why in sorted(_REFUSED_BASES.items())]
    if TRANSFORMERS_LAYERWISE_NAMES:
        lines += ["", "transformers' own names keep going through transformers unchanged: "]
        lines[-1] += ", ".join(f"`{n}`" for n in TRANSFORMERS_LAYERWISE_NAMES) + "."
    return "\n".join(lines)


def results_table() -> str:
    import importlib.util

    results = README.parent / "benchmarks" / "results" / "memory_suite.json"
    if not results.is_file():
        return "_No results yet: run `python benchmarks/memory_suite.py`._"
    spec = importlib.util.spec_from_file_location("memory_suite", README.parent / "benchmarks" / "memory_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.results_markdown(str(results)).strip()


SECTIONS = {"optimizers": optimizer_table, "results": results_table}


def render(text: str) -> str:
    for key, make in SECTIONS.items():
        match = re.search(rf"<!-- {key}:start -->\n.*?(?=<!-- {key}:end -->)", text, re.S)
        if not match:
            raise SystemExit(f"README.md has no <!-- {key}:start --> / <!-- {key}:end --> markers")
        text = text[: match.start()] + f"<!-- {key}:start -->\n{make()}\n" + text[match.end() :]
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail instead of writing when README.md is stale")
    args = parser.parse_args()
    current = README.read_text()
    fresh = render(current)
    if args.check:
        if fresh != current:
            print("README.md is stale: run python scripts/gen_readme.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
