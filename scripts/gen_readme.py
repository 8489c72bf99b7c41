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
MEMORY_SUITE_JSON = README.parent / "benchmarks" / "results" / "memory_suite.json"


def optimizer_table() -> str:
    from layerwise_hf.bases.registry import TRANSFORMERS_LAYERWISE_NAMES, describe_layerwise_optimizers
    from layerwise_hf.bases.support import REFUSED_BASES, base_status

    rows = {base: package for _, base, package in describe_layerwise_optimizers()}
    # grokadamw is the one refused base that needs a package of its own.
    rows.update({base: "grokadamw" if base == "grokadamw" else "" for base in REFUSED_BASES})
    lines = [
        "| `optim=` | Trainer base it resolves | extra package | against the standard `optim` (CPU) |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{b}_layerwise` | `{b}` | {p or '-'} | {base_status(b)} |" for b, p in sorted(rows.items())]
    if TRANSFORMERS_LAYERWISE_NAMES:
        lines += ["", "transformers' own names keep going through transformers unchanged: "]
        lines[-1] += ", ".join(f"`{n}`" for n in TRANSFORMERS_LAYERWISE_NAMES) + "."
    return "\n".join(lines)


def results_table(results: Path = MEMORY_SUITE_JSON) -> str:
    """The memory suite's results (a memory_suite.json, by default the committed one) as a markdown table."""
    import json

    if str(README.parent) not in sys.path:
        sys.path.append(str(README.parent))  # benchmarks/_common.py formats the numbers as the benchmarks print them
    from benchmarks._common import mib, pct

    results = Path(results)
    if not results.is_file():
        return "_No results yet: run `python benchmarks/memory_suite.py`._"
    report = json.loads(results.read_text())
    lines = [
        "| config | GA | peak RSS MiB | training peak MiB | grads MiB | state MiB | peak / floor | step time vs "
        "standard | estimate error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["configs"]:
        if "error" in c:
            error = c["error"].splitlines()[0].replace("|", "/")
            lines.append(f"| `{c['name']}` | {c['config']['ga']} | error: {error} | | | | | | |")
            continue
        a, t, est = c["analysis"], c.get("timing") or {}, c.get("estimate") or {}
        ratio = f"{t['ratio']:.3f}x" if "ratio" in t else "-"
        error = "n/a" if "error" in est else pct(a["estimate_errors"]["total_plus_activations_vs_peak"])
        lines.append(
            f"| `{c['name']}` | {c['config']['ga']} | {mib(a['peak_rss_bytes'])} | {mib(a['training_peak_bytes'])} | "
            f"{mib(a['grads_counted_bytes'])} | {mib(a['state_counted_bytes'])} | {a['floor_ratio']:.3f}x | {ratio} | "
            f"{error} |"
        )
    return "\n".join(lines)


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
