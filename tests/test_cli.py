"""`layerwise-hf`: the subcommands it lists, their help, and `estimate-memory` end to end (tables, JSON, exit codes,
errors on stderr without a traceback). Nothing is downloaded."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from layerwise_hf.cli import SUBCOMMANDS, build_parser, main
from layerwise_hf.estimate import list_presets

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30

# What `accelerate estimate-memory meta-llama/Llama-2-70b-hf` printed for float16 (its "GB" are GiB).
ACCELERATE_LLAMA2_70B_FP16_ADAM_GB = 512.59


def within(value, reference, rel=0.01):
    return abs(value - reference) <= rel * reference


# ---- the command and its subcommands ----


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: layerwise-hf") and "estimate-memory" in out and "convert-checkpoint" in out


def test_subcommand_list():
    parser = build_parser()
    (action,) = [a for a in parser._subparsers._group_actions]
    assert sorted(action.choices) == ["assets", "convert-checkpoint", "estimate-memory", "plan"]
    assert len(SUBCOMMANDS) == 4


def test_convert_checkpoint_help(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["convert-checkpoint", "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: layerwise-hf convert-checkpoint")


def test_estimate_memory_help(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["estimate-memory", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "--accelerate" in out and "llama-3.1-405b" in out and "adamw_8bit" in out


def test_bad_estimate_memory_argument_exits_2_with_usage(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["estimate-memory", "llama-2-7b", "--sharding", "zero3"])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: layerwise-hf estimate-memory")
    assert "argument --sharding: invalid choice: 'zero3'" in captured.err
    with pytest.raises(SystemExit) as exited:
        main(["estimate-memory", "llama-2-7b", "--world-size", "two"])
    assert exited.value.code == 2 and "invalid int value: 'two'" in capsys.readouterr().err


def test_bad_estimate_memory_value_is_one_line_on_stderr(capsys):
    # Parsed fine, refused by the estimator: exit status 2 like argparse, the message without a traceback.
    assert main(["estimate-memory", "llama-2-7b", "--world-size", "2", "--sharding", "none"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "layerwise-hf estimate-memory: error: world_size=2 with sharding='none': use ddp or fsdp2 for several "
        "devices.\n"
    )
    assert main(["estimate-memory"]) == 2
    assert "give a model" in capsys.readouterr().err


# ---- estimate-memory ----


def _cli(*args):
    return subprocess.Popen(
        [sys.executable, "-m", "layerwise_hf.cli", "estimate-memory", *args],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_cli_subprocess_json_and_bad_preset():
    # Both at once: most of each process's time is importing torch and transformers.
    good = _cli("llama-2-70b", "--dtypes", "fp16", "--json")
    bad = _cli("llama-9-7b")
    out, err = good.communicate(timeout=300)
    assert good.returncode == 0, err[-3000:]
    by_optim = {e["optimizer"]: e for e in json.loads(out)["estimates"]}
    assert set(by_optim) == {"adamw_torch", "adamw_torch_layerwise"}
    assert within(by_optim["adamw_torch"]["total_bytes"] / GIB, ACCELERATE_LLAMA2_70B_FP16_ADAM_GB)
    # The one-process route holds an MLP matrix's step (followed by the smaller attention ones) next to one of those.
    assert by_optim["adamw_torch_layerwise"]["gradient_bytes"] == (28672 + 8192) * 8192 * 2

    out, err = bad.communicate(timeout=300)
    assert bad.returncode == 2 and out == ""
    assert "Unknown model 'llama-9-7b'" in err and "Traceback" not in err
    for preset in list_presets():
        assert preset in err


def test_cli_table(capsys):
    assert main(["estimate-memory", "llama-2-70b", "--dtypes", "fp16", "--optim", "adamw_8bit_layerwise"]) == 0
    out = capsys.readouterr().out
    for header in ("Weights", "Gradients", "Optimizer state", "Total", "Per GPU"):
        assert header in out
    assert "adamw_8bit_layerwise" in out and "128.48 GiB" in out and "500.00 MiB" in out


def test_cli_accelerate_mode(capsys):
    assert main(["estimate-memory", "llama-2-70b", "--accelerate"]) == 0
    out = capsys.readouterr().out
    assert "Training using Adam" in out and "127.99 GB" in out and "511.96 GB" in out and "N/A" in out
    assert main(["estimate-memory", "llama-2-70b", "--accelerate", "--lora-rank", "8"]) == 2
    assert "--lora-rank" in capsys.readouterr().err


def test_cli_lora_fsdp2_and_presets(capsys):
    argv = ["estimate-memory", "llama-3-8b", "--lora-rank", "16", "--world-size", "2", "--sharding", "fsdp2"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert all(e["per_gpu_bytes"] == math.ceil(e["total_bytes"] / 2) for e in data["estimates"])
    assert main(["estimate-memory", "--list-presets"]) == 0
    out = capsys.readouterr().out
    assert "6,738,415,616" in out and all(p in out for p in list_presets())


def test_cli_ddp_bucket_cap(capsys):
    argv = ["estimate-memory", "llama-2-7b", "--world-size", "2", "--sharding", "ddp", "--json"]
    assert main([*argv, "--bucket-cap-mb", "100"]) == 0
    wide = {e["optimizer"]: e for e in json.loads(capsys.readouterr().out)["estimates"]}
    assert main(argv) == 0
    default = {e["optimizer"]: e for e in json.loads(capsys.readouterr().out)["estimates"]}
    layerwise, standard = default["adamw_torch_layerwise"], default["adamw_torch"]
    assert layerwise["bucket_cap_mb"] is None and wide["adamw_torch_layerwise"]["bucket_cap_mb"] == 100
    assert layerwise["gradient_bytes"] == layerwise["ddp_in_flight_bytes"] < standard["gradient_bytes"]
    assert wide["adamw_torch_layerwise"]["gradient_bytes"] > layerwise["gradient_bytes"]
    assert wide["adamw_torch"]["gradient_bytes"] == standard["gradient_bytes"]  # standard DDP: buckets = gradients
    assert main(argv[:-1]) == 0
    out = capsys.readouterr().out
    assert "Layer-wise gradients under DDP: at most" in out and "no persistent buckets" in out


def test_parser_registers_subcommands():
    from layerwise_hf import estimate as estimate_module

    args = build_parser().parse_args(["estimate-memory", "llama-2-7b"])
    assert args.func is estimate_module.run
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "0"], "world_size=0: the number of devices, a whole number >= 1"),
        (["--world-size", "-2", "--sharding", "fsdp2"], "world_size=-2: the number of devices"),
    ],
)
def test_estimate_memory_refuses_device_counts_below_one(capsys, argv, message):
    from layerwise_hf.cli import main

    assert main(["estimate-memory", "llama-3-8b", *argv]) == 2
    assert message in capsys.readouterr().err


def test_estimate_memory_refuses_negative_sizes_in_a_config(tmp_path, capsys):
    import json

    from layerwise_hf.cli import main

    config = {"model_type": "llama", "vocab_size": -32000, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["estimate-memory", str(tmp_path / "config.json")]) == 2
    assert "vocab_size=-32000 must be a whole number >= 1" in capsys.readouterr().err
