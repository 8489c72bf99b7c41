"""The supported version range (refusal, one warning for newer versions) and each version shim of
`layerwise_hf.platform.compat`, on whichever stack runs the tests (CI runs the fast tier on the oldest and newest
combinations too)."""

from __future__ import annotations

import inspect
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
from transformers import Trainer, TrainingArguments

import layerwise_hf
from layerwise_hf.integrations import patching
from layerwise_hf.platform import compat
from layerwise_hf.platform import versions as compat_versions

ROOT = Path(__file__).resolve().parents[1]


def _versions(monkeypatch, **versions):
    """Make the installed versions read as `versions` (package -> version string) for the other packages too."""
    real = compat.installed_version
    fake = lambda package: versions.get(package) or real(package)  # noqa: E731
    for module in (compat, compat_versions):  # the range's check lives in versions.py, the shims in compat.py
        monkeypatch.setattr(module, "installed_version", fake)
    monkeypatch.setattr(compat_versions, "_WARNED", set())


# ---------------------------------------------------------------- the range


def test_older_transformers_is_refused_with_versions_and_fix(monkeypatch):
    _versions(monkeypatch, transformers="4.54.1")
    with pytest.raises(compat.UnsupportedVersionError) as err:
        compat.check_versions()
    message = str(err.value)
    assert "transformers 4.54.1 (needs >= 4.55)" in message
    assert "tested: transformers 4.55 to 5.24, accelerate 1.10 to 1.15, torch 2.6 to 2.14" in message
    assert "pip install 'transformers>=4.55'" in message


def test_every_package_older_than_supported_is_named(monkeypatch):
    _versions(monkeypatch, accelerate="1.9.0", torch="2.5.1+cpu")
    with pytest.raises(compat.UnsupportedVersionError, match=r"accelerate 1\.9\.0 \(needs >= 1\.10\), torch 2\.5\.1"):
        compat.check_versions()


def test_importing_the_trainer_integration_refuses_an_older_version(monkeypatch):
    _versions(monkeypatch, transformers="4.50.0")
    # A fresh import of the package, as in a new process; the modules already loaded come back afterwards.
    for name in [n for n in sys.modules if n.startswith("layerwise_hf.integrations")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(compat.UnsupportedVersionError, match=r"transformers 4\.50\.0 \(needs >= 4\.55\)"):
        import layerwise_hf.integrations.trainer  # noqa: F401


def test_newer_version_warns_once_naming_the_tested_range_and_runs(monkeypatch):
    _versions(monkeypatch, transformers="5.25.0", torch="2.16.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.check_versions()
        compat.check_versions()
    untested = [str(w.message) for w in caught if issubclass(w.category, compat.UntestedVersionWarning)]
    assert len(untested) == 2  # once per package, not once per call
    assert all(
        "tested with transformers 4.55 to 5.24, accelerate 1.10 to 1.15, torch 2.6 to 2.14" in m for m in untested
    )
    assert any("transformers 5.25.0 is newer" in m for m in untested)
    assert any("torch 2.16.0 is newer" in m for m in untested)


def test_install_on_a_newer_version_whose_methods_match_warns_and_installs(monkeypatch, tmp_path):
    # A newer torch: the Trainer methods install() checks are transformers' own, whatever stack runs this.
    _versions(monkeypatch, torch="2.20.0")
    try:
        with pytest.warns(compat.UntestedVersionWarning, match="torch 2.20.0 is newer"):
            layerwise_hf.install()
        assert patching.is_installed()
        assert (
            TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise").optim == "adamw_torch_layerwise"
        )
    finally:
        layerwise_hf.uninstall()


@pytest.mark.parametrize("installed", ["4.55.0", "5.24.7", "4.57.6", "5.24.0.dev0"])
def test_versions_within_the_range_are_silent(monkeypatch, installed):
    _versions(monkeypatch, transformers=installed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_versions()


def test_supported_range_is_pyprojects_and_cis():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    oldest = _pins(ROOT / "ci" / "oldest.txt")
    newest = _pins(ROOT / "ci" / "newest.txt")
    for package, (low, high) in compat.SUPPORTED_VERSIONS.items():
        assert f"{package}>={low}" in deps  # no upper bound: newer versions warn instead
        assert _minor(newest[package]) == high
        if package != "torch":  # torch 2.6 - 2.12 are multi-GB CUDA downloads on x86_64 (README)
            assert _minor(oldest[package]) == low


def test_the_installed_stack_is_within_the_supported_range():
    for package, (low, _) in compat.SUPPORTED_VERSIONS.items():
        assert _release(compat.installed_version(package)) >= _release(low)


def _pins(path: Path) -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return dict(line.split("==") for line in lines if line)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.match(r"[\d.]+", version).group().rstrip(".").split("."))


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


# ---------------------------------------------------------------- the shims


def test_trainer_method_parameters_are_the_installed_trainers():
    for name, expected in compat.trainer_method_parameters().items():
        assert tuple(inspect.signature(getattr(Trainer, name)).parameters) == expected, name
    if "_clip_grad_norm" not in compat.trainer_method_parameters():
        assert not hasattr(Trainer, "_clip_grad_norm")  # transformers < 5.3 clips inline


@pytest.mark.parametrize("optim_args", [None, "", "rank=8", "rank=8, scale=0.5,proj_type=left"])
def test_parse_optim_args_without_trainer_optimizer_parses_like_it(monkeypatch, optim_args):
    with_module = compat.parse_optim_args(optim_args)
    monkeypatch.setattr(compat, "_trainer_optimizer", lambda: None)
    assert compat.parse_optim_args(optim_args) == with_module


def test_base_requirements_without_trainer_optimizer_are_transformers_lists(monkeypatch):
    module, with_module = compat._trainer_optimizer(), compat.optimizer_base_requirements()
    monkeypatch.setattr(compat, "_trainer_optimizer", lambda: None)
    without = compat.optimizer_base_requirements()
    if module is not None:  # the copy kept for transformers < 5.2 is transformers' own lists
        assert without == with_module
    assert without["adamw_8bit"] == "bitsandbytes" and without["adamw_torch_8bit"] == "torchao"


def test_is_optimizer_factory_without_trainer_optimizer(monkeypatch):
    monkeypatch.setattr(compat, "_trainer_optimizer", lambda: None)
    assert not compat.is_optimizer_factory(torch.optim.AdamW)
    assert compat.is_optimizer_factory(lambda params, model: None)


def test_safe_globals_loads_numpy_state_the_way_trainer_does(tmp_path):
    path = tmp_path / "rng_state.pth"
    torch.save({"python": 1, "numpy": np.random.get_state()}, path)
    with pytest.raises(Exception):  # noqa: B017 (torch raises its own UnpicklingError)
        torch.load(path, weights_only=True)
    with compat.safe_globals():
        assert torch.load(path, weights_only=True)["numpy"][0] == "MT19937"


@pytest.mark.parametrize("release", [(5, 17), (5, 18)])
def test_cpu_map_location_loads_an_indexed_cpu_device_where_trainer_passes_one(monkeypatch, tmp_path, release):
    # transformers < 5.18 resumes a multi-process CPU run with map_location=args.device ("cpu:0"), refused by torch.
    path = tmp_path / "optimizer.pt"
    torch.save({"state": {0: {"exp_avg": torch.arange(3.0)}}}, path)
    with pytest.raises(RuntimeError, match="cpu:0"):
        torch.load(path, map_location=torch.device("cpu", 0), weights_only=True)
    monkeypatch.setattr(compat, "_transformers_release", lambda: release)
    load = torch.load
    ranks = type("Args", (), {"world_size": 2, "device": torch.device("cpu", 0)})()
    with compat.cpu_map_location(ranks):
        if release < (5, 18):
            loaded = torch.load(path, map_location=torch.device("cpu", 0), weights_only=True)
            assert torch.equal(loaded["state"][0]["exp_avg"], torch.arange(3.0))
        else:  # transformers passes "cpu" itself: nothing is replaced
            assert torch.load is load
    assert torch.load is load
    one_process = type("Args", (), {"world_size": 1, "device": torch.device("cpu", 0)})()
    with compat.cpu_map_location(one_process):
        assert torch.load is load


@pytest.mark.parametrize("takes_model", [True, False])
def test_create_optimizer_args_follow_the_signature(monkeypatch, takes_model):
    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(compat, "create_optimizer_takes_model", lambda: takes_model)
    assert compat.create_optimizer_args(None) == ((None,) if takes_model else ())
    if takes_model:
        assert compat.create_optimizer_args(model) == (model,)
    else:
        with pytest.raises(TypeError, match="takes no model before transformers 5.3"):
            compat.create_optimizer_args(model)


def test_create_optimizer_takes_model_is_the_installed_trainers():
    assert compat.create_optimizer_takes_model() == ("model" in inspect.signature(Trainer.create_optimizer).parameters)


class _Accelerator:
    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        return "accelerate's"


class _Optimizer:
    def grad_norm(self):
        return torch.tensor(3.0)


@pytest.mark.parametrize("inline", [True, False])
def test_route_inline_grad_norm_only_where_trainer_clips_inline(monkeypatch, inline):
    monkeypatch.setattr(compat, "_trainer_clips_inline", lambda: inline)
    accelerator, current = _Accelerator(), [_Optimizer()]
    compat.route_inline_grad_norm(accelerator, lambda: current[0])
    compat.route_inline_grad_norm(accelerator, lambda: current[0])  # idempotent
    if inline:
        assert accelerator.clip_grad_norm_([], 1.0).item() == 3.0
        current[0] = None  # a standard optimizer: accelerate clips as before
        assert accelerator.clip_grad_norm_([], 1.0) == "accelerate's"
    else:
        assert "clip_grad_norm_" not in vars(accelerator)


def test_checkpointing_kwargs_turn_checkpointing_on(tmp_path):
    kwargs = compat.checkpointing_kwargs(True, {"use_reentrant": False})
    args = TrainingArguments(output_dir=str(tmp_path), **kwargs)
    (field,) = [k for k in kwargs if not k.endswith("_kwargs")]
    assert field in TrainingArguments.__dataclass_fields__
    assert getattr(args, field) is True and getattr(args, f"{field}_kwargs") == {"use_reentrant": False}


@pytest.mark.parametrize(
    "accelerate, transformers, sync_each_batch, reduces",
    [
        ("1.10.0", "4.55.0", False, True),  # accelerate's no_sync looks for a no_sync method FSDP2 does not have
        ("1.11.0", "5.24.0", False, False),  # set_requires_gradient_sync(False): accumulated unsharded
        ("1.15.0", "5.1.0", True, False),  # Trainer runs no_sync whatever sync_each_batch says
        ("1.15.0", "5.2.0", True, True),
    ],
)
def test_fsdp2_trainer_reduces_each_micro_batch_follows_the_releases(
    monkeypatch, accelerate, transformers, sync_each_batch, reduces
):
    _versions(monkeypatch, accelerate=accelerate, transformers=transformers)
    assert compat.fsdp2_trainer_reduces_each_micro_batch(sync_each_batch) == reduces
