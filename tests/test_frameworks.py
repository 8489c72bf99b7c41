"""axolotl and LLaMA-Factory: their own command lines, with the configs of examples/frameworks/, train layer-wise
bit-identically to the explicit classes (`LayerwiseTrainer` + `LayerwiseTrainingArguments`) on the data, model and
arguments the framework prepared, and to the framework's own run with the standard optimizer.

The framework tests run in a venv that has the framework (see docs/frameworks.md, "What was tested"):

    /tmp/venv-axolotl/bin/python -m pytest -q -p no:cacheprovider tests/test_frameworks.py

and skip, saying which package is missing, elsewhere. The plugin's hook logic is tested everywhere.

Run as a script, this file is the explicit run: `python tests/test_frameworks.py explicit {axolotl|llamafactory} CFG`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "frameworks"
OPTIM = "adamw_torch_layerwise"
WORDS = 56
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # axolotl sends usage telemetry unless told not to; this machine has no network.
    "AXOLOTL_DO_NOT_TRACK": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONPATH": str(ROOT),
}


def _missing(package: str) -> str | None:
    if importlib.util.find_spec(package) is None:
        return (
            f"{package} is not installed in this environment ({sys.executable}); the framework tests run in a venv "
            "with it, see docs/frameworks.md"
        )
    return None


needs_axolotl = pytest.mark.skipif(_missing("axolotl") is not None, reason=str(_missing("axolotl")))
needs_llamafactory = pytest.mark.skipif(_missing("llamafactory") is not None, reason=str(_missing("llamafactory")))


# ---------------------------------------------------------------- tiny local model and data


def make_assets(folder: Path) -> Path:
    """A word-level tokenizer, a random-init 2-layer Llama saved from its config, and 32 text / instruction rows."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", "<bos>", "<eos>", *(f"w{i}" for i in range(WORDS))])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )
    model_dir = folder / "model"
    tokenizer.save_pretrained(model_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )
    LlamaForCausalLM(config).save_pretrained(model_dir)
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(32):
        start = int(torch.randint(0, WORDS, (1,), generator=g))
        words = [f"w{(start + k) % WORDS}" for k in range(12)]
        rows.append({"text": " ".join(words), "instruction": " ".join(words[:6]), "output": " ".join(words[6:])})
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir


# The keys a test changes in an example config: tiny local model and data, a few CPU steps, a checkpoint mid-way.
SHORT_RUN = {"max_grad_norm": 1.0, "weight_decay": 0.1, "warmup_steps": 1, "save_steps": 2, "logging_steps": 1}


def axolotl_config(tmp_path: Path, name: str, optimizer: str | None, plugin: bool = True, **extra) -> Path:
    """examples/frameworks/axolotl-tiny.yaml (the GPU config with the CPU lines the guide states) with the model, data
    and size swapped for the test's own."""
    cfg = yaml.safe_load((EXAMPLES / "axolotl-tiny.yaml").read_text())
    if not plugin:
        cfg.pop("plugins")
        cfg.pop("layerwise_clip", None)
    if optimizer is not None:
        cfg["optimizer"] = optimizer
    cfg.update(
        base_model=str(tmp_path / "model"),
        tokenizer_type="PreTrainedTokenizerFast",
        datasets=[{"path": str(tmp_path / "data.jsonl"), "ds_type": "json", "type": "completion"}],
        dataset_prepared_path=str(tmp_path / f"prepared_{name}"),
        output_dir=str(tmp_path / name),
        sequence_len=16,
        micro_batch_size=4,
        max_steps=4,
        learning_rate=0.01,
        tf32=False,
        seed=0,
        **SHORT_RUN,
        **extra,
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def llamafactory_config(tmp_path: Path, name: str, optim: str | None, **extra) -> Path:
    """examples/frameworks/llamafactory-tiny.yaml (the GPU config with the CPU lines the guide states) with the model,
    data and size swapped for the test's own."""
    cfg = yaml.safe_load((EXAMPLES / "llamafactory-tiny.yaml").read_text())
    if optim is not None:
        cfg["optim"] = optim
    columns = {"prompt": "instruction", "response": "output"} if cfg["stage"] == "sft" else {"prompt": "text"}
    (tmp_path / "dataset_info.json").write_text(json.dumps({"tiny": {"file_name": "data.jsonl", "columns": columns}}))
    cfg.update(
        model_name_or_path=str(tmp_path / "model"),
        dataset="tiny",
        dataset_dir=str(tmp_path),
        template="empty",
        cutoff_len=16,
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=0.01,
        seed=0,
        overwrite_cache=True,
        preprocessing_num_workers=1,
        **SHORT_RUN,
        **extra,
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(*command, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=900, check=False
    )
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), f"{key}: max difference {(wa[key] - wb[key]).abs().max()}"


def assert_trained(folder: Path, initial: Path) -> None:
    moved = {k: (v - weights(initial)[k]).abs().max().item() for k, v in weights(folder).items()}
    assert min(moved.values()) > 0, moved


def losses(folder: Path) -> list[float]:
    """The logged losses, from the last checkpoint (axolotl saves no trainer_state.json beside the final model)."""
    state = json.loads((folder / "checkpoint-4" / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def assert_same_layerwise_checkpoint(a: Path, b: Path) -> None:
    """Weights and the layer-wise optimizer state of one checkpoint, bit-identical; both complete."""
    assert_same_weights(a, b)
    sa, sb = (torch.load(p / "optimizer.pt", weights_only=True) for p in (a, b))
    assert [g["name"] for g in sa["param_groups"]] == [g["name"] for g in sb["param_groups"]]
    for name, state in sa["state"].items():
        for key, value in state.items():
            other = sb["state"][name][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (name, key)
    assert (a / "layerwise_complete.json").exists() and (b / "layerwise_complete.json").exists()


# ---------------------------------------------------------------- the explicit run (this file as a script)


def explicit_axolotl(config: str) -> None:
    """axolotl prepares the model, data and arguments from CONFIG (standard optimizer, no plugin); the explicit
    classes train them."""
    from axolotl.cli.args import TrainerCliArgs
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.train import setup_model_and_trainer

    cfg = load_cfg(config)
    prepared, model, tokenizer, _, _ = setup_model_and_trainer(cfg, load_datasets(cfg=cfg, cli_args=TrainerCliArgs()))
    _train_explicitly(prepared, model, tokenizer)


def explicit_llamafactory(config: str) -> None:
    """LLaMA-Factory's own workflow builds its trainer from CONFIG (standard optimizer); the explicit classes train
    its model, data and collator with its arguments."""
    from llamafactory.train.tuner import run_exp
    from transformers import Trainer

    built = {}
    original = Trainer.train

    class Built(Exception):
        pass

    def capture(self, *args, **kwargs):
        built["trainer"] = self
        raise Built

    # Everything up to train() is LLaMA-Factory's own workflow (its data, collator, model loading, arguments).
    Trainer.train = capture
    sys.argv = [sys.argv[0], config]
    try:
        run_exp()
    except Built:
        pass
    finally:
        Trainer.train = original
    prepared = built["trainer"]
    _train_explicitly(prepared, prepared.model, prepared.processing_class)


def _train_explicitly(prepared, model, tokenizer) -> None:
    from transformers import TrainingArguments

    from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments

    values = {f.name: getattr(prepared.args, f.name) for f in dataclasses.fields(TrainingArguments) if f.init}
    args = LayerwiseTrainingArguments(**{**values, "optim": OPTIM})
    trainer = LayerwiseTrainer(
        model=model,
        args=args,
        train_dataset=prepared.train_dataset,
        data_collator=prepared.data_collator,
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    trainer.save_state()


# ---------------------------------------------------------------- axolotl


@pytest.mark.slow
@needs_axolotl
def test_axolotl_plugin_run_is_bit_identical_to_explicit_classes_and_to_stock_adamw(tmp_path):
    make_assets(tmp_path)
    plugin = axolotl_config(tmp_path, "plugin", OPTIM)
    stock = axolotl_config(tmp_path, "stock", "adamw_torch", plugin=False)
    explicit = axolotl_config(tmp_path, "explicit", "adamw_torch", plugin=False)
    result = run(sys.executable, "-m", "axolotl.cli.train", plugin, cwd=tmp_path)  # what a user runs
    run(sys.executable, "-m", "axolotl.cli.train", stock, cwd=tmp_path)
    run(sys.executable, __file__, "explicit", "axolotl", explicit, cwd=tmp_path)

    assert "layerwise_peak_grad_mib" in result.stdout + result.stderr  # the layer-wise optimizer logged
    assert_trained(tmp_path / "plugin", tmp_path / "model")
    assert_same_weights(tmp_path / "plugin", tmp_path / "explicit")
    assert_same_weights(tmp_path / "plugin", tmp_path / "stock")
    assert losses(tmp_path / "plugin") == losses(tmp_path / "explicit") == losses(tmp_path / "stock")
    assert len(losses(tmp_path / "plugin")) == 4
    assert_same_layerwise_checkpoint(tmp_path / "plugin" / "checkpoint-2", tmp_path / "explicit" / "checkpoint-2")


@pytest.mark.slow
@needs_axolotl
def test_axolotl_plugin_resumes_bit_identically(tmp_path):
    make_assets(tmp_path)
    whole = axolotl_config(tmp_path, "whole", OPTIM)
    run(sys.executable, "-m", "axolotl.cli.train", whole, cwd=tmp_path)
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    resumed = axolotl_config(tmp_path, "resumed", OPTIM, resume_from_checkpoint=str(checkpoint))
    run(sys.executable, "-m", "axolotl.cli.train", resumed, cwd=tmp_path)
    assert_same_weights(tmp_path / "whole", tmp_path / "resumed")


@pytest.mark.slow
@needs_axolotl
def test_axolotl_without_the_plugins_line_fails_as_the_guide_says(tmp_path):
    # The guide's "Without the `plugins:` line": transformers' error, which the plugin never loaded cannot add to.
    make_assets(tmp_path)
    config = axolotl_config(tmp_path, "plain", OPTIM, plugin=False)
    result = subprocess.run(
        [sys.executable, "-m", "axolotl.cli.train", str(config)],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode != 0
    assert f"{OPTIM} is not a valid OptimizerNames" in result.stderr
    guide = (ROOT / "docs" / "frameworks.md").read_text()
    assert "is not a valid OptimizerNames" in guide[guide.index("## axolotl") : guide.index("## LLaMA-Factory")]


# ---------------------------------------------------------------- LLaMA-Factory


@pytest.mark.slow
@needs_llamafactory
@pytest.mark.parametrize("stage", ["sft", "pt"])
def test_llamafactory_through_launcher_is_bit_identical_to_explicit_classes_and_to_stock_adamw(tmp_path, stage):
    make_assets(tmp_path)
    launched = llamafactory_config(tmp_path, "launched", OPTIM, stage=stage)
    stock = llamafactory_config(tmp_path, "stock", "adamw_torch", stage=stage)
    explicit = llamafactory_config(tmp_path, "explicit", "adamw_torch", stage=stage)
    # What a user runs: LLaMA-Factory's command line, unchanged, under the launcher.
    result = run(sys.executable, "-m", "layerwise_hf", "-m", "llamafactory.cli", "train", launched, cwd=tmp_path)
    run(sys.executable, "-m", "llamafactory.cli", "train", stock, cwd=tmp_path)
    run(sys.executable, __file__, "explicit", "llamafactory", explicit, cwd=tmp_path)

    assert "layerwise_peak_grad_mib" in result.stdout + result.stderr
    assert_trained(tmp_path / "launched", tmp_path / "model")
    assert_same_weights(tmp_path / "launched", tmp_path / "explicit")
    assert_same_weights(tmp_path / "launched", tmp_path / "stock")
    assert losses(tmp_path / "launched") == losses(tmp_path / "explicit") == losses(tmp_path / "stock")
    assert len(losses(tmp_path / "launched")) == 4
    assert_same_layerwise_checkpoint(tmp_path / "launched" / "checkpoint-2", tmp_path / "explicit" / "checkpoint-2")


@pytest.mark.slow
@needs_llamafactory
def test_llamafactory_on_two_processes_with_the_launcher_in_each_matches_stock_ddp(tmp_path):
    # llamafactory-cli's own torchrun start runs its launcher.py in new processes; the launcher goes in each instead.
    make_assets(tmp_path)
    launched = llamafactory_config(tmp_path, "launched", OPTIM, ddp_backend="gloo")
    stock = llamafactory_config(tmp_path, "stock", "adamw_torch", ddp_backend="gloo")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    result = run(*torchrun, free_port(), "-m", "layerwise_hf", "-m", "llamafactory.launcher", launched, cwd=tmp_path)
    run(*torchrun, free_port(), "-m", "llamafactory.launcher", stock, cwd=tmp_path)

    assert "world size: 2" in result.stdout + result.stderr
    assert "layerwise_peak_grad_mib" in result.stdout + result.stderr
    assert_trained(tmp_path / "launched", tmp_path / "model")
    assert_same_weights(tmp_path / "launched", tmp_path / "stock")
    assert losses(tmp_path / "launched") == losses(tmp_path / "stock")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@needs_llamafactory
def test_llamafactory_without_launcher_refuses_the_name_as_transformers_does(tmp_path):
    make_assets(tmp_path)
    config = llamafactory_config(tmp_path, "plain", OPTIM)
    result = subprocess.run(
        [sys.executable, "-m", "llamafactory.cli", "train", str(config)],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode != 0
    assert f"{OPTIM} is not a valid OptimizerNames" in result.stderr


# ---------------------------------------------------------------- the axolotl plugin's hooks (no axolotl needed)


@pytest.fixture
def plugin():
    from layerwise_hf.integrations.axolotl import LayerwisePlugin
    from layerwise_hf.integrations.patching import is_installed, uninstall

    assert not is_installed()
    made = LayerwisePlugin()
    yield made
    uninstall()


def test_plugin_register_installs_and_post_train_unload_uninstalls(plugin, tmp_path):
    from helpers import tiny_llama
    from transformers import Trainer, TrainingArguments

    from layerwise_hf import LayerwiseCallback, LayerwiseTrainerMixin
    from layerwise_hf.integrations.patching import is_installed

    cfg = {"optimizer": "adamw_8bit_layerwise", "layerwise_clip": "previous"}  # as axolotl hands over the YAML
    plugin.register(cfg)
    assert is_installed()
    # What axolotl builds next: its TrainingArguments / Trainer subclasses, with `optimizer` passed as `optim`.
    args_cls = type("AxolotlTrainingArguments", (TrainingArguments,), {})
    args_cls = dataclasses.dataclass(args_cls)
    trainer_cls = type("AxolotlTrainer", (Trainer,), {})
    args = args_cls(output_dir=str(tmp_path), optim="adamw_8bit_layerwise", report_to="none", use_cpu=True)
    trainer = trainer_cls(model=tiny_llama(), args=args)
    assert isinstance(trainer, LayerwiseTrainerMixin) and isinstance(trainer, trainer_cls)
    assert trainer.args.layerwise_clip == "previous"
    plugin.post_trainer_create(cfg, trainer)  # no complaint
    # axolotl's logging shows INFO from axolotl.* loggers only: the run's account goes through one.
    (callback,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, LayerwiseCallback)]
    assert callback.report_logger.name.startswith("axolotl.")
    plugin.post_train_unload(cfg)
    assert not is_installed()


def test_plugin_changes_nothing_for_a_standard_optimizer(plugin, caplog):
    from layerwise_hf.integrations.patching import is_installed

    with caplog.at_level(logging.WARNING):
        plugin.register({"optimizer": "adamw_torch"})
    assert not is_installed()
    assert "is not a layer-wise name: it changes nothing" in caplog.text


def test_plugin_leaves_an_install_it_did_not_make(plugin):
    import layerwise_hf
    from layerwise_hf.integrations.patching import is_installed

    layerwise_hf.install()  # e.g. axolotl started under `python -m layerwise_hf`
    plugin.register({"optimizer": "sgd_layerwise"})
    plugin.post_train_unload({"optimizer": "sgd_layerwise"})
    assert is_installed()


def test_plugin_refuses_a_trainer_built_without_the_mixin(plugin, tmp_path):
    from helpers import tiny_llama
    from transformers import Trainer

    from layerwise_hf import LayerwiseTrainingArguments

    args = LayerwiseTrainingArguments(output_dir=str(tmp_path), optim="sgd_layerwise", report_to="none")
    trainer = Trainer(model=tiny_llama(), args=args)  # built before register(): a stock Trainer
    with pytest.raises(RuntimeError, match="created without the layer-wise mixin.*listed in `plugins:`"):
        plugin.post_trainer_create({"optimizer": "sgd_layerwise"}, trainer)


def test_plugin_undoes_its_install_when_axolotl_rejects_the_config(plugin):
    from layerwise_hf.integrations.patching import is_installed

    plugin.register({"optimizer": "sgd_layerwise"})
    assert is_installed()
    plugin.on_config_validation_error({"optimizer": "sgd_layerwise"})
    assert not is_installed()


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"optimizer": "adamw_nope_layerwise"}, r"Unknown optimizer 'adamw_nope_layerwise'.*adamw_torch_layerwise"),
        ({"optimizer": "sgd_layerwise", "layerwise_clip": "sometimes"}, r"layerwise_clip='sometimes'.*exact"),
        ({"optimizer": "adamw_torch", "layerwise_clip": "previous"}, r"optimizer='adamw_torch' is not a layer-wise"),
        ({"optimizer": "sgd_layerwise", "lr_groups": [{"name": "a"}]}, r"does not read axolotl's lr_groups"),
        ({"optimizer": "sgd_layerwise", "embedding_lr_scale": 0.5}, r"does not read axolotl's embedding_lr_scale"),
        ({"optimizer": "sgd_layerwise", "loraplus_lr_ratio": 16}, r"does not read axolotl's loraplus_lr_ratio"),
    ],
    ids=["unknown-name", "bad-clip", "clip-without-layerwise", "lr_groups", "embedding_lr_scale", "loraplus"],
)
def test_plugin_refuses_bad_config_before_anything_is_installed(plugin, cfg, message):
    from layerwise_hf.integrations.patching import is_installed

    with pytest.raises(ValueError, match=message):
        plugin.register(cfg)
    assert not is_installed()


# ---------------------------------------------------------------- the example configs


def test_example_configs_turn_the_plugin_on():
    from layerwise_hf import is_layerwise_name
    from layerwise_hf.integrations.axolotl import PLUGIN, layerwise_settings

    axolotl = yaml.safe_load((EXAMPLES / "axolotl.yaml").read_text())
    assert PLUGIN in axolotl["plugins"]
    module, name = PLUGIN.rsplit(".", 1)
    assert hasattr(importlib.import_module(module), name)  # what axolotl's load_plugin resolves
    assert layerwise_settings(axolotl) == {"layerwise_clip": axolotl["layerwise_clip"]}
    llamafactory = yaml.safe_load((EXAMPLES / "llamafactory.yaml").read_text())
    assert is_layerwise_name(llamafactory["optim"])
    for path in EXAMPLES.glob("*.yaml"):
        first = path.read_text().splitlines()[0]
        assert first.startswith("# ") and f"examples/frameworks/{path.name}" in first, f"{path}: no launch command"
        for line in path.read_text().splitlines():
            if ":" in line and not line.lstrip().startswith(("#", "-")) and not line.rstrip().endswith(":"):
                assert " # " in line, f"{path}: every key needs a comment: {line!r}"


# What the tiny configs change in the GPU ones: the model, data and size of `layerwise-hf assets tiny out/tiny`, and
# the lines a CPU machine needs (as docs/frameworks.md states them, with the GPU value they replace).
TINY_LINES = {
    "axolotl": {
        "base_model", "tokenizer_type", "datasets", "dataset_prepared_path", "output_dir", "sequence_len", "max_steps",
        "learning_rate", "warmup_steps", "save_steps", "logging_steps", "optimizer",
    },
    "llamafactory": {
        "model_name_or_path", "dataset", "dataset_dir", "template", "cutoff_len", "max_steps", "output_dir",
        "per_device_train_batch_size", "learning_rate", "preprocessing_num_workers", "save_steps", "logging_steps",
        "optim",
    },
}  # fmt: skip
CPU_LINES = {
    "axolotl": {"bf16": (False, "auto"), "fp16": (False, None)},
    "llamafactory": {"bf16": (False, True), "use_cpu": (True, None)},
}


@pytest.mark.parametrize("framework", sorted(CPU_LINES))
def test_tiny_config_is_the_gpu_config_with_the_lines_the_guide_states(framework):
    gpu = yaml.safe_load((EXAMPLES / f"{framework}.yaml").read_text())
    tiny = yaml.safe_load((EXAMPLES / f"{framework}-tiny.yaml").read_text())
    changed = {k: (tiny.get(k), gpu.get(k)) for k in gpu.keys() | tiny.keys() if tiny.get(k) != gpu.get(k)}
    assert {k: v for k, v in changed.items() if k in CPU_LINES[framework]} == CPU_LINES[framework]
    assert changed.keys() - CPU_LINES[framework].keys() == TINY_LINES[framework]
    guide = (ROOT / "docs" / "frameworks.md").read_text()
    for key, (value, _) in CPU_LINES[framework].items():
        assert f"{key}: {str(value).lower()}" in guide, f"the guide does not state {key}: {value}"
    assert f"examples/frameworks/{framework}-tiny.yaml" in guide
    # Everything the tiny run reads or writes is under out/, which .gitignore keeps out of the clone's status.
    paths = [v for k, v in tiny.items() if k.endswith(("_dir", "_path", "base_model")) and isinstance(v, str)]
    paths += [d["path"] for d in tiny.get("datasets", [])]
    assert paths and all(str(p).startswith("out/") for p in paths), paths
    assert "out/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_guide_s_offline_variables_are_the_ones_the_tests_run_with():
    guide = (ROOT / "docs" / "frameworks.md").read_text()
    lines = [x for x in guide.splitlines() if x.startswith("export HF_HUB_OFFLINE=1")]
    documented = {tuple(tuple(p.split("=")) for p in line.removeprefix("export ").split()) for line in lines}
    documented = [dict(pairs) for pairs in documented]
    assert sorted(map(sorted, documented)) == [
        ["AXOLOTL_DO_NOT_TRACK", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"],
        ["HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"],
    ]
    assert all(ENV[k] == v for variables in documented for k, v in variables.items())
    assert "AXOLOTL_DO_NOT_TRACK=1" in guide and "telemetry" in guide


def guide_block(marker: str) -> str:
    """The bash block that follows `<!-- marker -->` in docs/frameworks.md."""
    guide = (ROOT / "docs" / "frameworks.md").read_text()
    after = guide[guide.index(f"<!-- {marker} -->") :]
    start = after.index("```bash\n") + len("```bash\n")
    return after[start : after.index("```", start)]


def test_the_guide_s_test_commands_install_what_pytest_s_settings_need():
    # pyproject's addopts pass xdist's -n: a venv without pytest-xdist stops at "unrecognized arguments".
    addopts = __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    guide = (ROOT / "docs" / "frameworks.md").read_text()
    installs = [x for x in guide.splitlines() if "pip install" in x and " pytest" in x]
    assert len(installs) == 2  # one venv a framework
    if "-n " in addopts["addopts"]:
        assert all("pytest-xdist" in x for x in installs), installs
    runs = [x for x in guide.splitlines() if "-m pytest" in x]
    assert runs and all(x.endswith("tests/test_frameworks.py") for x in runs)


def test_first_run_blocks_use_the_tiny_configs_and_the_assets_they_read():
    for framework, command in [("axolotl", "axolotl train"), ("llamafactory", "-m llamafactory.cli train")]:
        block = guide_block(f"first-run: {framework}").splitlines()
        assert block[1] == "layerwise-hf assets tiny out/tiny"
        assert command in block[2] and block[2].endswith(f"examples/frameworks/{framework}-tiny.yaml")
        config = yaml.safe_load((EXAMPLES / f"{framework}-tiny.yaml").read_text())
        model = config.get("base_model") or config["model_name_or_path"]
        assert model == "out/tiny/model"


FIRST_RUN = {
    "axolotl": pytest.param("axolotl", "axolotl-tiny", marks=needs_axolotl),
    "llamafactory": pytest.param("llamafactory", "llamafactory-tiny", marks=needs_llamafactory),
}


@pytest.mark.slow
@pytest.mark.parametrize("framework, output", list(FIRST_RUN.values()), ids=list(FIRST_RUN))
def test_first_run_as_the_guide_says(tmp_path, framework, output):
    # The guide's commands, word for word, in a fresh folder that holds the clone's examples, with the venv's bin
    # first on PATH as `source .../activate` puts it (axolotl train starts the venv's accelerate by name).
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {**ENV, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "AXOLOTL_DO_NOT_TRACK"):
        env.pop(k)  # the block's own export sets what it needs
    block = guide_block(f"first-run: {framework}")
    result = subprocess.run(
        ["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    assert "Training layer-wise: adamw_torch_layerwise, one AdamW per trainable parameter" in log
    summary = [
        x for x in log.splitlines() if "Layer-wise memory (adamw_torch_layerwise): gradients alive at once" in x
    ]
    assert len(summary) == 1, log[-3000:]
    out = tmp_path / "out" / output
    assert (out / "model.safetensors").exists()
    assert (out / "checkpoint-20" / "layerwise_complete.json").exists()
    assert_trained(out, tmp_path / "out" / "tiny" / "model")


# ---------------------------------------------------------------- layerwise-hf assets


def test_assets_command_writes_a_model_and_data_both_frameworks_read(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from layerwise_hf.cli import main

    assert main(["assets", "tiny", str(tmp_path / "tiny")]) == 0
    assert "dataset: tiny_alpaca" in capsys.readouterr().out
    tiny = tmp_path / "tiny"
    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    text = "### Instruction:\nSpell the word café backwards.\n\n### Response:\n"  # alpaca's prompt, non-ASCII too
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<pad>", "</s>")
    model = AutoModelForCausalLM.from_pretrained(tiny / "model")
    assert model.config.vocab_size == len(tokenizer)
    assert 0.3e6 < sum(p.numel() for p in model.parameters()) < 0.5e6  # trains in seconds on a CPU
    # LLaMA-Factory resolves dataset names through dataset_info.json, relative to dataset_dir.
    info = json.loads((tiny / "dataset_info.json").read_text())
    for name, entry in info.items():
        rows = [json.loads(x) for x in (tiny / entry["file_name"]).read_text().splitlines()]
        columns = set(entry.get("columns", {"prompt": "instruction", "query": "input", "response": "output"}).values())
        assert len(rows) == 256 and all(columns <= row.keys() for row in rows), name
    # Every alpaca prompt fits the configs' sequence length (axolotl drops longer rows, and with none left it fails).
    longest = max(
        len(tokenizer(r["instruction"] + r["output"])["input_ids"])
        for r in map(json.loads, open(tiny / "alpaca.jsonl"))
    )
    assert longest + 120 < yaml.safe_load((EXAMPLES / "axolotl-tiny.yaml").read_text())["sequence_len"]


def test_assets_are_the_same_for_the_same_seed_and_refuse_to_overwrite(tmp_path):
    from layerwise_hf.cli import main

    main(["assets", "tiny", str(tmp_path / "a")])
    main(["assets", "tiny", str(tmp_path / "b")])
    for name in ("model/model.safetensors", "alpaca.jsonl", "model/tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    with pytest.raises(SystemExit, match="already holds tiny assets.*--overwrite"):
        main(["assets", "tiny", str(tmp_path / "a")])
    assert main(["assets", "tiny", str(tmp_path / "a"), "--overwrite", "--seed", "1"]) == 0
    assert (tmp_path / "a" / "alpaca.jsonl").read_bytes() != (tmp_path / "b" / "alpaca.jsonl").read_bytes()
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="is a file"):
        main(["assets", "tiny", str(tmp_path / "file")])


if __name__ == "__main__":
    _, what, framework, config = sys.argv
    assert what == "explicit", sys.argv
    {"axolotl": explicit_axolotl, "llamafactory": explicit_llamafactory}[framework](config)
