"""`layerwise-hf plan`: a simulated step on fake tensors against real CPU runs, the layer-wise saving where gradients
dominate, rule-only optimizers, the layer extrapolation against the full simulation, fits / headroom, JSON, and bad
input refused before any simulation."""

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import PLAN_LLAMA
from transformers import AutoConfig, AutoModelForCausalLM

from layerwise_hf.cli import main
from layerwise_hf.estimate import EstimateError, estimate
from layerwise_hf.plan import LiveBytes, max_micro_batch, parse_size, plan
from layerwise_hf.plan import core as plan_core

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import plan_accuracy  # noqa: E402

LLAMA = PLAN_LLAMA
# Gradients dominate: wide layers, 8 tokens, activation checkpointing.
WIDE = dict(LLAMA, hidden_size=256, intermediate_size=1024, vocab_size=256)


def real_peak(model_cfg: dict, optim: str, **setup) -> int:
    """The benchmark's real run (CPU allocator events over the second step) for a model config of our own."""
    plan_accuracy.MODELS["test"] = model_cfg
    try:
        cfg = plan_accuracy.Config("test", optim, **setup)
        return plan_accuracy.measure_real(cfg, max_grad_norm=1.0)["peak_bytes"]
    finally:
        del plan_accuracy.MODELS["test"]


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_layerwise"])
@pytest.mark.parametrize(
    "model, setup",
    [
        (LLAMA, dict(seq_len=64, micro_batch=2)),  # activations dominate
        (WIDE, dict(seq_len=8, checkpointing=True)),  # gradients dominate: where layer-wise changes the peak
    ],
    ids=["activations", "gradients"],
)
def test_plan_matches_the_real_run(optim, model, setup):
    options = {k: v for k, v in setup.items() if k != "checkpointing"}
    result = plan(model, [optim], **options, gradient_checkpointing=setup.get("checkpointing", False), device="cpu",
                  counterparts=False)  # fmt: skip
    row = result.rows[0]
    real = real_peak(model, optim, **setup)
    assert abs(row.peak_bytes / real - 1) < 0.03, (row.peak_bytes, real)
    assert sum(row.categories.values()) == row.peak_bytes
    # Buffers (rotary frequencies) count as weights too.
    built = AutoModelForCausalLM.from_config(AutoConfig.for_model(**model))
    buffers = sum(b.numel() * b.element_size() for b in built.buffers())
    weights = estimate(model, optimizer="adamw_torch", dtype="float32").weight_bytes
    assert row.categories["weights"] == weights + buffers


def test_layerwise_gradients_smaller_where_gradients_dominate():
    result = plan(WIDE, ["adamw_torch"], seq_len=8, gradient_checkpointing=True, max_grad_norm=0.0, device="cpu")
    standard, layerwise = result.row("adamw_torch"), result.row("adamw_torch_layerwise")
    assert standard.categories["gradients"] > 4 * layerwise.categories["gradients"]
    assert layerwise.peak_bytes < standard.peak_bytes
    assert layerwise.saving_bytes == standard.peak_bytes - layerwise.peak_bytes > 0
    # Standard: every gradient alive at the step; layer-wise: at most about the largest one.
    all_grads = estimate(WIDE, optimizer="adamw_torch", dtype="float32").gradient_bytes
    assert standard.categories["gradients"] == all_grads
    assert "gradients dominate" in " ".join(standard.advice)


def test_lora_trains_only_the_adapters():
    result = plan(LLAMA, ["adamw_torch"], seq_len=32, lora_r=4, device="cpu")
    full = plan(LLAMA, ["adamw_torch"], seq_len=32, device="cpu", counterparts=False).rows[0]
    expected = estimate(LLAMA, optimizer="adamw_torch", dtype="float32", lora_rank=4)
    for row in result.rows:
        # PEFT's adapters in float32 with AdamW's two moments and step: byte-exact with the estimator.
        assert row.categories["optimizer_state"] == expected.optimizer_state_bytes
        assert row.categories["gradients"] <= expected.gradient_bytes
        assert row.peak_bytes < full.peak_bytes


def test_activation_checkpointing_lowers_activations():
    options = dict(seq_len=256, device="cpu", counterparts=False, max_grad_norm=0.0)
    plain = plan(LLAMA, ["adamw_torch"], **options).rows[0]
    checkpointed = plan(LLAMA, ["adamw_torch"], gradient_checkpointing=True, **options).rows[0]
    assert checkpointed.categories["activations"] < plain.categories["activations"] / 2
    assert any("activation checkpointing" in a for a in plain.advice)
    assert not any("activation checkpointing" in a for a in checkpointed.advice)


def test_rule_only_optimizer_takes_the_estimators_state():
    result = plan(LLAMA, ["adamw_8bit"], seq_len=16, device="cpu")
    for name in ("adamw_8bit", "adamw_8bit_layerwise"):
        row = result.row(name)
        assert row.optimizer_state_from_rule
        expected = estimate(LLAMA, optimizer=name, dtype="float32").optimizer_state_bytes
        assert row.categories["optimizer_state"] == expected
    assert "(state: rule)" in result.format()


def test_extrapolated_layers_equal_the_full_simulation():
    deep = dict(LLAMA, num_hidden_layers=5)
    options = dict(seq_len=16, gradient_checkpointing=True, device="cpu")
    fast = plan(deep, ["adamw_torch"], **options)
    full = plan(deep, ["adamw_torch"], extrapolate=False, **options)
    assert fast.extrapolated and not full.extrapolated
    for a, b in zip(fast.rows, full.rows):
        assert (a.peak_bytes, a.categories) == (b.peak_bytes, b.categories), a.optimizer


def test_fits_and_headroom_between_the_two_peaks():
    probe = plan(WIDE, ["adamw_torch"], seq_len=8, gradient_checkpointing=True, max_grad_norm=0.0, device="cpu")
    low, high = sorted(r.peak_bytes for r in probe.rows)
    memory = (low + high) // 2
    result = plan(
        WIDE,
        ["adamw_torch"],
        seq_len=8,
        gradient_checkpointing=True,
        max_grad_norm=0.0,
        device="cpu",
        device_memory=memory,
    )
    assert result.row("adamw_torch").fits is False
    assert result.row("adamw_torch_layerwise").fits is True
    for row in result.rows:
        assert row.headroom_bytes == memory - row.peak_bytes
    assert "does not fit" in result.format()


def test_cli_json_schema(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    assert main(["plan", str(config), "--seq-len", "16", "--device-memory", "1GiB", "--json", "--device", "cpu"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["device_memory"] == 2**30 and payload["setup"]["seq_len"] == 16
    assert [r["optimizer"] for r in payload["optimizers"]] == ["adamw_torch", "adamw_torch_layerwise"]
    for row in payload["optimizers"]:
        assert set(row["categories"]) == {"weights", "gradients", "optimizer_state", "activations", "temporaries"}
        assert row["peak_bytes"] == sum(row["categories"].values())
        assert row["fits"] is True and row["headroom_bytes"] == 2**30 - row["peak_bytes"]


def test_max_micro_batch_bisects():
    calls = []

    class Row:
        def __init__(self, fits):
            self.fits = fits

    class Fake:
        def __init__(self, batch):
            calls.append(batch)
            self.fits = batch <= 13

        def row(self, name):
            return Row(self.fits)

    assert max_micro_batch(Fake, "x") == (13, len(calls))
    assert max_micro_batch(lambda b: Fake(b * 100), "x")[0] == 0


def test_cli_max_batch_size_finds_the_largest_that_fits(capsys):
    options = dict(seq_len=64, device="cpu", counterparts=False)
    peaks = [plan(LLAMA, ["adamw_torch"], micro_batch=b, **options).rows[0].peak_bytes for b in (2, 3)]
    assert peaks[0] < peaks[1]
    memory = str(sum(peaks) // 2)
    args = [
        "plan",
        "llama-3.2-1b",
        "--seq-len",
        "64",
        "--device-memory",
        memory,
        "--max-batch-size",
        "--json",
        "--device",
        "cpu",
    ]
    # The command line takes a preset or a file; the tiny model comes in through plan()'s config lookup.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_core, "resolve_config", lambda model: (AutoConfig.for_model(**LLAMA), "tiny", ""))
        assert main([*args, "--optim", "adamw_torch"]) == 0
    rows = {r["optimizer"]: r for r in json.loads(capsys.readouterr().out)["optimizers"]}
    assert rows["adamw_torch"]["max_micro_batch"] == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["no-such-model"], "Presets: "),
        (["llama-3-8b", "--seq-len", "0"], "seq_len=0 must be a whole number >= 1"),
        (["llama-3-8b", "--micro-batch", "-2"], "micro_batch=-2"),
        (["llama-3-8b", "--grad-accum", "0"], "grad_accum=0"),
        (["llama-3-8b", "--optim", "adamw_nope"], "choose one of adafactor, adagrad"),
        (["llama-3-8b", "--torch-dtype", "int3"], "choose one of float32, bfloat16, float16"),
        (["llama-3-8b", "--device-memory", "lots"], "--device-memory 'lots'"),
        (["llama-3-8b", "--max-batch-size"], "--max-batch-size needs --device-memory"),
    ],
)
def test_bad_input_is_refused_before_any_simulation(args, message, monkeypatch, capsys):
    monkeypatch.setattr(plan_core, "simulate", lambda *a, **k: pytest.fail("simulated despite bad input"))
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("layerwise-hf plan: error: ") and message in err, err


def test_non_causal_config_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_core, "simulate", lambda *a, **k: pytest.fail("simulated despite bad input"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "vit", "hidden_size": 64}))
    with pytest.raises(EstimateError, match="no causal language model for model_type 'vit'"):
        plan(str(config))


def test_parse_size():
    assert parse_size("80GiB") == parse_size("80G") == 80 * 2**30
    assert parse_size("80GB") == 80 * 10**9
    with pytest.raises(EstimateError, match="above 0"):
        parse_size("0GiB")


def test_tracker_splits_categories():
    tracker = LiveBytes()
    w = torch.nn.Parameter(torch.zeros(100))
    with tracker:
        tracker.track_tensors([w], "weights")
        x = torch.ones(50, requires_grad=True)
        y = (x * 2).sum()  # grad mode on: activations
        with torch.no_grad():
            t = torch.empty(1000)  # grad mode off: a temporary
            del t
    assert tracker.totals["weights"] == 400
    assert tracker.peak.total == tracker.current + 4000
    assert tracker.peak.by_category["temporaries"] == 4000
    del y


@pytest.mark.slow
def test_plan_accuracy_benchmark_small(tmp_path):
    assert plan_accuracy.main(["--small", "--output_dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "plan_accuracy.json").read_text())
    assert report["configurations"] == 4
    assert all(abs(row["error"]) <= plan_accuracy.GOAL for row in report["rows"]), report["rows"]


# A Mixtral-shaped and a Qwen3-MoE-shaped model (4 experts, 2 per token): their experts run `torch._grouped_mm`.
MIXTRAL = dict(model_type="mixtral", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128,
                 moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, num_experts=4, num_experts_per_tok=2)  # fmt: skip
GPT2 = dict(model_type="gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128)


def _config_dir(tmp_path, values: dict) -> str:
    path = tmp_path / values["model_type"]
    path.mkdir()
    (path / "config.json").write_text(json.dumps(values))
    return str(path)


@pytest.mark.parametrize("model", [MIXTRAL, QWEN3_MOE], ids=["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_moe_plans_at_every_dtype_its_kernels_take(model, dtype, tmp_path, capsys):
    # The meta kernel of grouped_mm takes bfloat16 only; the CPU kernel and CUDA's fallback take all three.
    code = main(["plan", _config_dir(tmp_path, model), "--seq-len", "16", "--torch-dtype", dtype, "--json"])
    if not _experts_run_grouped_mm(model):
        # Older transformers route tokens to experts with a loop over `nonzero`, whose output shape depends on the
        # data: fake tensors cannot run it, and the planner says so (exit 2, no traceback).
        err = capsys.readouterr().err
        assert code == 2 and "DynamicOutputShapeException" in err and "Traceback" not in err, err
        return
    assert code == 0
    rows = json.loads(capsys.readouterr().out)["optimizers"]
    assert {r["optimizer"] for r in rows} == {"adamw_torch", "adamw_torch_layerwise"}


def _experts_run_grouped_mm(values: dict) -> bool:
    # transformers 5 gives MoE configs an experts implementation (grouped_mm by default, set when the model is
    # built); 4.x has no such setting, only a per-expert loop.
    return hasattr(AutoConfig.for_model(**values), "_experts_implementation")


def test_moe_plan_matches_the_real_float32_run():
    # What the real run executes on CPU in float32: grouped_mm's CPU kernel, the experts' outputs in float32.
    if not _experts_run_grouped_mm(MIXTRAL):
        pytest.skip("this transformers runs experts in a data-dependent loop; the planner refuses it (tested above)")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**MIXTRAL))
    assert model.config._experts_implementation == "grouped_mm"
    row = plan(MIXTRAL, ["adamw_torch"], seq_len=32, device="cpu", counterparts=False).rows[0]
    real = real_peak(MIXTRAL, "adamw_torch", seq_len=32)
    assert abs(row.peak_bytes / real - 1) < 0.03, (row.peak_bytes, real)


def test_an_error_inside_the_simulation_names_the_model_and_the_setting(tmp_path, monkeypatch, capsys):
    from layerwise_hf.plan import simulate as plan_simulate

    def broken(*args, **kwargs):
        raise RuntimeError("Expected inputs of BF16 type but got mat_a.dtype=torch.float32\nsecond line")

    monkeypatch.setattr(plan_simulate, "run_step", broken)
    assert main(["plan", _config_dir(tmp_path, MIXTRAL), "--seq-len", "16", "--bf16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("layerwise-hf plan: error: mixtral (model_type 'mixtral'): the simulated step failed with "
                          "--optim adamw_torch --torch-dtype float32 --seq-len 16 --micro-batch 1 --bf16: "
                          "RuntimeError: Expected inputs of BF16 type"), err  # fmt: skip
    assert "second line" not in err and "Traceback" not in err


def test_lora_targets_default_to_peft_s_for_the_architecture(tmp_path, capsys):
    assert main(["plan", _config_dir(tmp_path, GPT2), "--seq-len", "16", "--lora-r", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["lora_targets"] == ["c_attn"]  # peft's default for gpt2
    assert out["optimizers"][0]["categories"]["optimizer_state"] > 0


@pytest.mark.parametrize(
    "model, targets",
    [(GPT2, ["q_proj", "v_proj"]), (LLAMA, ["query", "value"])],
    ids=["gpt2-llama-targets", "llama-no-match"],
)
def test_lora_targets_that_match_nothing_are_refused(model, targets, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plan_core, "simulate", lambda *a, **k: pytest.fail("simulated despite bad input"))
    args = ["plan", _config_dir(tmp_path, model), "--lora-r", "4", "--lora-target-modules", *targets]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("layerwise-hf plan: error: ") and f"--lora-target-modules {' '.join(targets)}" in err, err
    linear = "c_attn, c_fc, c_proj, lm_head" if model is GPT2 else "down_proj, gate_proj, k_proj, lm_head, o_proj"
    assert f"its linear modules LoRA can target: {linear}" in err, err
    assert "Traceback" not in err


def test_a_config_transformers_refuses_is_an_error_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plan_core, "simulate", lambda *a, **k: pytest.fail("simulated despite bad input"))
    bad = dict(LLAMA, hidden_size=30, num_attention_heads=4)
    try:
        AutoConfig.for_model(**bad)
    except Exception:  # noqa: BLE001 - transformers 5 raises huggingface_hub's validation error, 4.x nothing
        pass
    else:
        pytest.skip("this transformers does not check the heads against the hidden size when a config is made")
    path = _config_dir(tmp_path, bad)
    assert main(["plan", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"layerwise-hf plan: error: {path}: transformers refuses this config: "), err
    assert "hidden size (30) is not a multiple of the number of attention heads (4)" in err and "Traceback" not in err
