"""Regenerate the generated sections of README.md and docs/*.md from the code, so they cannot drift.

A section is the text between `<!-- key:start -->` and `<!-- key:end -->`; each key lives in exactly one of those
files, found by its markers, so a table follows its text when the text moves to another page.

python scripts/gen_readme.py          # rewrite the files whose sections are stale
python scripts/gen_readme.py --check  # exit 1 if any is stale (the test suite runs this)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
MEMORY_SUITE_JSON = README.parent / "benchmarks" / "results" / "memory_suite.json"


def doc_files() -> list[Path]:
    """Every page that may hold a generated section: the README and the guides."""
    return [README, *sorted((README.parent / "docs").glob("*.md"))]


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


def _section(key: str) -> re.Pattern:
    return re.compile(rf"<!-- {key}:start -->\n.*?(?=<!-- {key}:end -->)", re.S)


def render(texts: dict[Path, str]) -> dict[Path, str]:
    """The pages with every section regenerated; each key must be in exactly one page."""
    fresh = dict(texts)
    for key, make in SECTIONS.items():
        pages = [path for path, text in fresh.items() if _section(key).search(text)]
        if len(pages) != 1:
            where = ", ".join(str(p.relative_to(README.parent)) for p in pages) or "no page"
            raise SystemExit(f"<!-- {key}:start --> / <!-- {key}:end --> must be in one page, found in {where}")
        text = fresh[pages[0]]
        match = _section(key).search(text)
        fresh[pages[0]] = text[: match.start()] + f"<!-- {key}:start -->\n{make()}\n" + text[match.end() :]
    return fresh


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail instead of writing when a page is stale")
    args = parser.parse_args()
    current = {path: path.read_text() for path in doc_files()}
    fresh = render(current)
    stale = [path for path in current if fresh[path] != current[path]]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(README.parent)} is stale: run python scripts/gen_readme.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(fresh[path])
    return 0


if __name__ == "__main__":
    sys.exit(main())
