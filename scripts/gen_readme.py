"""Regenerate the generated sections of README.md and docs/*.md from the code, so they cannot drift.

A section is the text between `<!-- key:start -->` and `<!-- key:end -->`; each key lives in exactly one of those
files, found by its markers, so a table follows its text when the text moves to another page.

python scripts/gen_readme.py          # rewrite the files whose sections are stale
python scripts/gen_readme.py --check  # exit 1 if any is stale (the test suite runs this)
python scripts/gen_readme.py --plans  # rerun the sizing guide's plans (minutes) into sizing_plans.json, then rewrite

The sizing guide's `layerwise-hf plan` tables come from benchmarks/results/sizing_plans.json (a simulation takes
minutes, too long for every test run); the JSON keeps the settings each table was planned with, so a table whose
settings change here reads as stale until `--plans` reruns it.
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


SIZING_PLANS_JSON = README.parent / "benchmarks" / "results" / "sizing_plans.json"
# The sizing guide's plans: per table, its rows (a label and plan()'s keywords), the options every row shares, and the
# device sizes it is read against.
_BF16 = dict(bf16=True, torch_dtype="bfloat16", gradient_checkpointing=True, micro_batch=1, device="cuda")
PLAN_TABLES = {
    "plan-8b": dict(
        model="llama-3-8b",
        options=dict(_BF16, seq_len=4096),
        devices=["24GiB", "40GiB", "80GiB"],
        rows=[
            ("adamw_torch", {}),
            ("adamw_torch_layerwise", {}),
            ("adamw_8bit", {}),
            ("adamw_8bit_layerwise", {}),
            ("adafactor", {}),
            ("adafactor_layerwise", {}),
            ("adamw_torch", dict(lora_r=16, lora_targets=("q_proj", "v_proj"))),
            ("adamw_torch_layerwise", dict(lora_r=16, lora_targets=("q_proj", "v_proj"))),
        ],
    ),
    "plan-70b": dict(
        model="llama-2-70b",
        options=dict(_BF16, seq_len=4096, world_size=8, sharding="fsdp2"),
        devices=["80GiB"],
        # No standard adamw_8bit: bitsandbytes cannot step FSDP2's DTensors (plan() refuses it, as a run fails).
        rows=[("adamw_torch", {}), ("adamw_torch_layerwise", {}), ("adamw_8bit_layerwise", {})],
    ),
    # When host offload pays (docs/offload.md): Llama-3-8B on one 24 GiB device, Trainer's defaults (exact clipping),
    # each main optimizer without offload and with both modes; then gradient accumulation 4.
    "plan-8b-offload": dict(
        model="llama-3-8b",
        options=dict(_BF16, seq_len=4096),
        devices=["24GiB"],
        rows=[("adamw_torch", {})]
        + [
            (f"{base}_layerwise", dict(offload=mode))
            for base in ("adamw_torch", "adamw_8bit", "adafactor")
            for mode in ("none", "gradients", "optimizer")
        ]
        + [("adamw_torch_layerwise", dict(offload=mode, grad_accum=4)) for mode in ("none", "gradients", "optimizer")],
    ),  # fmt: skip
}


def _row_label(optimizer: str, extra: dict) -> str:
    label = f"`{optimizer}`" + (f" + LoRA r={extra['lora_r']}" if extra.get("lora_r") else "")
    return label + (f", GA {extra['grad_accum']}" if extra.get("grad_accum", 1) > 1 else "")


def _settings(table: dict) -> dict:
    """A table's settings as JSON stores them (tuples as lists), to tell a stale entry."""
    import json

    return json.loads(json.dumps({k: table[k] for k in ("model", "options", "rows")}))


def run_plans(keys: list[str], path: Path = SIZING_PLANS_JSON) -> None:
    """Rerun the plans of `keys` (all when empty) and store them in `path`, next to the others already there."""
    import json
    import time

    from layerwise_hf.plan import plan

    stored = json.loads(path.read_text()) if path.is_file() else {}
    for key in keys or list(PLAN_TABLES):
        table = PLAN_TABLES[key]
        rows, t0 = [], time.perf_counter()
        for optimizer, extra in table["rows"]:
            result = plan(table["model"], [optimizer], counterparts=False, **table["options"], **extra)
            rows.append(result.to_dict())
            print(f"{key}: {_row_label(optimizer, extra)} {result.rows[0].peak_bytes} bytes", file=sys.stderr)
        stored[key] = {**_settings(table), "seconds": round(time.perf_counter() - t0, 1), "plans": rows}
        path.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")  # each table as soon as it is planned


def plan_table(key: str, path: Path = SIZING_PLANS_JSON) -> str:
    """One of the sizing guide's `layerwise-hf plan` tables, from `path`."""
    import json

    from layerwise_hf.estimate.units import format_bytes
    from layerwise_hf.plan.core import parse_size

    table = PLAN_TABLES[key]
    stored = json.loads(path.read_text()).get(key) if path.is_file() else None
    if stored is None or {k: stored[k] for k in ("model", "options", "rows")} != _settings(table):
        return f"_Not planned with these settings yet: run `python scripts/gen_readme.py --plans {key}`._"
    names = ("weights", "gradients", "optimizer_state", "activations", "temporaries")
    fits = [f"fits {d.replace('GiB', ' GiB')}" for d in table["devices"]]
    lines = [
        "| optimizer | peak | weights | gradients | optimizer state | activations | temporaries | "
        + " | ".join(fits)
        + " | the peak falls at |",
        "|---" * (8 + len(fits)) + "|",
    ]
    fitting: dict[str, list[str]] = {d: [] for d in table["devices"]}
    for (optimizer, extra), result in zip(table["rows"], stored["plans"]):
        (row,) = result["optimizers"]
        label = _row_label(optimizer, extra) + (" (state: rule)" if row["optimizer_state_from_rule"] else "")
        cells = [label, f"**{format_bytes(row['peak_bytes'])}**"]
        cells += [format_bytes(row["categories"][c]) for c in names]
        for device in table["devices"]:
            spare = parse_size(device) - row["peak_bytes"]
            cells.append(f"yes ({format_bytes(spare)} left)" if spare >= 0 else "no")
            # A row with less than a GiB left says so where it is listed: the CUDA context alone takes about that.
            tight = f" ({format_bytes(spare)} left)" if 0 <= spare < 2**30 else ""
            fitting[device] += [_row_label(optimizer, extra) + tight] if spare >= 0 else []
        lines.append("| " + " | ".join([*cells, row["when"]]) + " |")
    lines.append("")
    for device, labels in fitting.items():
        lines.append(f"Fits {device.replace('GiB', ' GiB')}: {', '.join(labels) or 'none of these'}.")
    how = "every layer simulated" if table["options"].get("extrapolate") is False else "identical layers extrapolated"
    lines.append(f"The {len(table['rows'])} plans took {stored['seconds']} s in all ({how}) on a shared 2-core CPU.")
    return "\n".join(lines)


def offload_table(key: str, path: Path = SIZING_PLANS_JSON) -> str:
    """The offload guide's table: per optimizer and `layerwise_offload`, the device peak, the host peak and whether
    the device peak fits, from `path`."""
    import json

    from layerwise_hf.estimate.units import format_bytes
    from layerwise_hf.plan.core import parse_size

    table = PLAN_TABLES[key]
    stored = json.loads(path.read_text()).get(key) if path.is_file() else None
    if stored is None or {k: stored[k] for k in ("model", "options", "rows")} != _settings(table):
        return f"_Not planned with these settings yet: run `python scripts/gen_readme.py --plans {key}`._"
    fits = [f"fits {d.replace('GiB', ' GiB')}" for d in table["devices"]]
    lines = [
        "| optimizer | `layerwise_offload` | device peak | gradients | optimizer state | host peak | host: states | "
        + " | ".join(fits)
        + " | the device peak falls at |",
        "|---" * (7 + len(fits) + 1) + "|",
    ]
    for (optimizer, extra), result in zip(table["rows"], stored["plans"]):
        (row,) = result["optimizers"]
        label = _row_label(optimizer, extra) + (" (state: rule)" if row["optimizer_state_from_rule"] else "")
        mode = extra.get("offload", "none") if optimizer.endswith("_layerwise") else "- (standard)"
        host = row.get("host_categories") or {}
        cats = row["categories"]
        cells = [label, f"`{mode}`" if not mode.startswith("-") else mode, f"**{format_bytes(row['peak_bytes'])}**",
                 format_bytes(cats["gradients"]), format_bytes(cats["optimizer_state"]),
                 format_bytes(row.get("host_peak_bytes", 0)),
                 format_bytes(host.get("optimizer_state", 0))]  # fmt: skip
        for device in table["devices"]:
            spare = parse_size(device) - row["peak_bytes"]
            cells.append(f"yes ({format_bytes(spare)} left)" if spare >= 0 else "no")
        lines.append("| " + " | ".join([*cells, row["when"]]) + " |")
    lines.append("")
    options = table["options"]
    lines.append(
        f"`layerwise-hf plan {table['model']} --bf16 --torch-dtype bfloat16 --gradient-checkpointing --seq-len "
        f"{options['seq_len']} --optim <optimizer> --offload none gradients optimizer --device-memory 24GiB`: "
        f"micro-batch {options['micro_batch']}, Trainer's exact clipping (max_grad_norm 1.0), GA 1 unless the row "
        f"says otherwise. The {len(table['rows'])} plans took {stored['seconds']} s in all on a shared 2-core CPU."
    )
    return "\n".join(lines)


SECTIONS = {
    "optimizers": optimizer_table,
    "results": results_table,
    "plan-8b": lambda: plan_table("plan-8b"),
    "plan-70b": lambda: plan_table("plan-70b"),
    "plan-8b-offload": lambda: offload_table("plan-8b-offload"),
}


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
    parser.add_argument(
        "--plans",
        nargs="*",
        choices=list(PLAN_TABLES),
        help="first rerun these sizing plans (all when none is named) into benchmarks/results/sizing_plans.json",
    )
    args = parser.parse_args()
    if args.plans is not None:
        run_plans(args.plans)
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
