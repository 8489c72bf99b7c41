"""LayerwiseTrainingArguments from Python, command lines, YAML/JSON; serialisation; clear errors."""

import copy
import json
import pickle

import pytest
import torch
import yaml
from transformers import HfArgumentParser
from transformers.training_args import OptimizerNames

from layerwise_hf import LayerwiseTrainingArguments, list_layerwise_optimizers


def make(tmp_path, **kwargs):
    return LayerwiseTrainingArguments(output_dir=str(tmp_path), report_to="none", **kwargs)


def test_python(tmp_path):
    args = make(tmp_path, optim="adamw_8bit_layerwise", adam_beta2=0.95)
    assert args.optim == "adamw_8bit_layerwise" and args.is_layerwise
    assert args.adam_beta2 == 0.95


def test_command_line(tmp_path):
    parser = HfArgumentParser(LayerwiseTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--optim", "adamw_8bit_layerwise"])
    assert args.optim == "adamw_8bit_layerwise"
    help_text = parser.format_help()
    assert "sgd_layerwise" in help_text


def test_switches_from_the_command_line_and_yaml_are_bools(tmp_path):
    # The strict bool check must not refuse what HfArgumentParser turns into bools.
    parser = HfArgumentParser(LayerwiseTrainingArguments)
    for flags, expected in (([], False), (["--layerwise_accept_nonfinite_state"], True),
                            (["--layerwise_accept_nonfinite_state", "false"], False)):  # fmt: skip
        (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), *flags])
        assert args.layerwise_accept_nonfinite_state is expected
    config = {"output_dir": str(tmp_path), "optim": "sgd_layerwise", "layerwise_accept_nonfinite_state": True}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    (from_yaml,) = parser.parse_yaml_file(str(tmp_path / "c.yaml"))
    assert from_yaml.layerwise_accept_nonfinite_state is True


def test_yaml_and_json(tmp_path):
    parser = HfArgumentParser(LayerwiseTrainingArguments)
    config = {"output_dir": str(tmp_path), "optim": "lion_32bit_layerwise", "learning_rate": 1e-4}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "c.json").write_text(json.dumps(config))
    (from_yaml,) = parser.parse_yaml_file(str(tmp_path / "c.yaml"))
    (from_json,) = parser.parse_json_file(str(tmp_path / "c.json"))
    assert from_yaml.optim == from_json.optim == "lion_32bit_layerwise"


def test_serialisation_round_trips(tmp_path):
    args = make(tmp_path, optim="sgd_layerwise")
    assert json.loads(args.to_json_string())["optim"] == "sgd_layerwise"
    assert copy.deepcopy(args).optim == "sgd_layerwise"
    assert pickle.loads(pickle.dumps(args)).optim == "sgd_layerwise"
    # Trainer saves training_args.bin with torch.save; it must load back as our class.
    torch.save(args, tmp_path / "training_args.bin")
    loaded = torch.load(tmp_path / "training_args.bin", weights_only=False)
    assert isinstance(loaded, LayerwiseTrainingArguments) and loaded.optim == "sgd_layerwise"
    # Rebuilding from to_dict (what TRL and accelerate configs do) validates again.
    rebuilt = LayerwiseTrainingArguments(**{k: v for k, v in args.to_dict().items() if not k.startswith("_")})
    assert rebuilt.optim == "sgd_layerwise"


def test_standard_and_transformers_layerwise_names_unchanged(tmp_path):
    assert make(tmp_path, optim="adamw_torch").optim == OptimizerNames.ADAMW_TORCH
    # transformers' own layer-wise names are served by this plugin now (scheduled lr, weight decay, checkpoints).
    assert make(tmp_path, optim="galore_adamw_layerwise").optim == "galore_adamw_layerwise"
    assert make(tmp_path, optim="galore_adamw_layerwise").is_layerwise


def test_set_optimizer(tmp_path):
    args = make(tmp_path).set_optimizer(name="rmsprop_layerwise", learning_rate=0.5)
    assert args.optim == "rmsprop_layerwise" and args.learning_rate == 0.5


@pytest.mark.parametrize("name", ["adamw_9bit_layerwise", "adamw_9bit", "Adamw_torch_layerwise"])
def test_unknown_name_lists_valid_ones(tmp_path, name):
    with pytest.raises(ValueError, match="Unknown optimizer") as err:
        make(tmp_path, optim=name)
    for valid in ("adamw_8bit_layerwise", "sgd_layerwise", "galore_adamw_layerwise", "adamw_torch"):
        assert valid in str(err.value)


@pytest.mark.parametrize("name", ["adamw_torch_layerwize", "ADAMW_TORCH_LAYERWISE"])
def test_a_typo_gets_the_close_names(tmp_path, name):
    with pytest.raises(ValueError, match=r"Did you mean 'adamw_torch_layerwise'") as err:
        make(tmp_path, optim=name)
    # transformers' galore names are served here: listed once, among the layer-wise ones.
    assert str(err.value).count("'galore_adamw_layerwise'") + str(err.value).count("galore_adamw_layerwise,") == 1


@pytest.mark.parametrize("name", ["lomo_layerwise", "adalomo_layerwise", "galore_adamw_layerwise_layerwise"])
def test_refused_names(tmp_path, name):
    with pytest.raises(ValueError, match="not supported|Unknown optimizer"):
        make(tmp_path, optim=name)


def test_refused_base_says_why(tmp_path):
    with pytest.raises(ValueError, match="already layer-wise"):
        make(tmp_path, optim="lomo_layerwise")
    with pytest.raises(ValueError, match="schedule-free"):
        make(tmp_path, optim="schedule_free_adamw_layerwise")


def test_list_has_every_per_tensor_base():
    names = list_layerwise_optimizers()
    for base in (
        "adamw_torch",
        "adamw_torch_fused",
        "adamw_8bit",
        "adamw_bnb_8bit",
        "paged_adamw_8bit",
        "paged_adamw_32bit",
        "lion_8bit",
        "lion_32bit",
        "paged_lion_8bit",
        "adafactor",
        "sgd",
        "adagrad",
        "rmsprop",
        "rmsprop_bnb_8bit",
        "ademamix",
        "ademamix_8bit",
        "adamw_torch_4bit",
        "adamw_torch_8bit",
    ):
        assert f"{base}_layerwise" in names
    assert not any(n.startswith(("lomo", "adalomo", "schedule_free")) for n in names)
    for name in ("galore_adamw_layerwise", "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise"):
        assert name in names
    assert names == sorted(names)


def test_training_args_pickled_by_0_1_still_load(tmp_path, monkeypatch):
    # A 0.1 checkpoint's training_args.bin names the class by the module path before the package had folders.
    args = LayerwiseTrainingArguments(str(tmp_path), optim="adamw_torch_layerwise", learning_rate=3e-4)
    monkeypatch.setattr(LayerwiseTrainingArguments, "__module__", "layerwise_hf.training_args")
    data = pickle.dumps(args)
    monkeypatch.undo()
    assert b"layerwise_hf.training_args" in data and b"integrations" not in data
    loaded = pickle.loads(data)
    assert type(loaded) is LayerwiseTrainingArguments
    assert loaded.optim == "adamw_torch_layerwise" and loaded.learning_rate == 3e-4


@pytest.mark.parametrize("value", [None, "twice", 2])
def test_a_bad_layerwise_norm_pass_names_the_field_and_the_ways(tmp_path, value):
    with pytest.raises(ValueError, match=r"layerwise_norm_pass=.* choose one of auto, retain, rerun, hold"):
        LayerwiseTrainingArguments(str(tmp_path), optim="adamw_torch_layerwise", layerwise_norm_pass=value)


@pytest.mark.parametrize("mode", ["gradients", "optimizer"])
def test_offload_docstring_help_and_guide_agree_that_fp16_works(tmp_path, mode):
    # The class docstring, the field's --help and docs/offload.md make one claim, and the arguments keep it.
    import re
    from pathlib import Path

    doc = LayerwiseTrainingArguments.__doc__
    entry = doc[doc.index("layerwise_offload (`str`") : doc.index("layerwise_host_step (`str`")]
    entry = re.sub(r"\s+", " ", entry)
    assert "Not with fp16" not in entry
    assert "With fp16 (a GradScaler) both modes work" in entry
    help_text = LayerwiseTrainingArguments.__dataclass_fields__["layerwise_offload"].metadata["help"]
    assert "fp16 with a GradScaler works in both modes" in help_text
    guide = (Path(__file__).resolve().parent.parent / "docs" / "offload.md").read_text()
    assert "**fp16 (`fp16=True`, a GradScaler).** Both modes work with loss scaling." in guide
    args = make(tmp_path, optim="adamw_torch_layerwise", fp16=True, use_cpu=True, layerwise_offload=mode)
    assert args.fp16 and args.layerwise_offload == mode
