"""`python -m layerwise_hf SCRIPT` and `layerwise_hf.install()`: stock scripts, `TrainingArguments`, `HfArgumentParser`
and `Trainer` (subclasses and TRL's included) take `--optim X_layerwise` unchanged, and train bit-identically to the
explicit classes (`LayerwiseTrainer`, `LayerwiseTrainingArguments`, `LayerwiseSFTTrainer`), checkpoints and resume
included."""

import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_params_equal, tiny_llama
from safetensors.torch import load_file
from transformers import HfArgumentParser, Trainer, TrainingArguments

import layerwise_hf
from layerwise_hf import LayerwiseTrainer, LayerwiseTrainerMixin, LayerwiseTrainingArguments
from layerwise_hf.integrations import patching
from layerwise_hf.integrations.launcher import main as launcher_main

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "run_clm_like.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _load_script():
    spec = importlib.util.spec_from_file_location("run_clm_like", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_clm_like = _load_script()


@pytest.fixture
def installed():
    layerwise_hf.install()
    try:
        yield
    finally:
        layerwise_hf.uninstall()


def clm_argv(output_dir, optim="adamw_torch_layerwise", *extra):
    return [
        "--output_dir", str(output_dir), "--optim", optim, "--max_steps", "4", "--learning_rate", "1e-2",
        "--weight_decay", "0.1", "--lr_scheduler_type", "cosine", "--warmup_steps", "1", "--max_grad_norm", "1.0",
        "--per_device_train_batch_size", "4", "--logging_steps", "1", "--save_steps", "2", "--report_to", "none",
        "--use_cpu", "--seed", "0", "--data_seed", "0", "--disable_tqdm", "true", *extra,
    ]  # fmt: skip


def explicit_run(output_dir, *extra):
    """The same program with the explicit classes."""
    argv = clm_argv(output_dir, "adamw_torch_layerwise", *extra)
    return run_clm_like.main(LayerwiseTrainer, LayerwiseTrainingArguments, argv)


def assert_same_files(a: Path, b: Path):
    """Weights and optimizer state bit-identical; the optimizer state is the layer-wise one."""
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    if (a / "optimizer.pt").exists():
        sa, sb = (torch.load(p / "optimizer.pt", weights_only=True) for p in (a, b))
        assert [g["name"] for g in sa["param_groups"]] == [g["name"] for g in sb["param_groups"]]
        assert _flat(sa["state"]).keys() == _flat(sb["state"]).keys() and _flat(sa["state"])
        for k, v in _flat(sa["state"]).items():
            w = _flat(sb["state"])[k]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, k
        assert (b / "layerwise_complete.json").exists()


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}/").items()}
    return {prefix: tree}


# ---------------------------------------------------------------- install() / uninstall()


def test_nothing_is_patched_at_import():
    code = (
        "import layerwise_hf, layerwise_hf.__main__, layerwise_hf.integrations.patching, "
        "layerwise_hf.integrations.launcher\n"
        "from transformers import HfArgumentParser, Trainer, TrainingArguments\n"
        "assert '__new__' not in vars(Trainer) and TrainingArguments.__annotations__['optim'] is not str\n"
        "for f in (TrainingArguments.__post_init__, TrainingArguments.set_optimizer, "
        "HfArgumentParser._add_dataclass_arguments, Trainer.get_optimizer_cls_and_kwargs):\n"
        "    assert f.__module__.startswith('transformers.'), f\n"
        "try:\n    TrainingArguments(output_dir='o', optim='adamw_torch_layerwise')\n"
        "except ValueError as e:\n    print('refused', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused adamw_torch_layerwise is not a valid OptimizerNames" in result.stdout


def test_install_is_idempotent_and_uninstall_restores_every_method(tmp_path):
    owners = {TrainingArguments: ["__post_init__", "set_optimizer"], Trainer: ["get_optimizer_cls_and_kwargs"]}
    before = {(o, n): vars(o)[n] for o, names in owners.items() for n in names}
    optim = TrainingArguments.__dataclass_fields__["optim"]
    annotation, metadata = TrainingArguments.__annotations__["optim"], optim.metadata
    layerwise_hf.install()
    try:
        patched = {(o, n): vars(o)[n] for o, n in before}
        assert all(patched[k] is not before[k] for k in before)
        layerwise_hf.install()
        assert all(vars(o)[n] is patched[(o, n)] for o, n in before)
        assert TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise").optim == (
            "adamw_torch_layerwise"
        )
    finally:
        layerwise_hf.uninstall()
    layerwise_hf.uninstall()
    # Every original is back, behind a check that only adds the fix to its error for a layer-wise name.
    assert all(_unwrapped(vars(o)[n]) is _unwrapped(before[(o, n)]) for o, n in before)
    assert TrainingArguments.__annotations__["optim"] is annotation and optim.metadata is metadata
    assert not patching.is_installed()
    with pytest.raises(ValueError) as err:
        TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise")
    assert str(err.value).startswith("adamw_torch_layerwise is not a valid OptimizerNames")  # transformers' own
    assert "layerwise_hf.uninstall() was called" in str(err.value) and "layerwise_hf.install() again" in str(err.value)
    with pytest.raises(ValueError) as err:
        TrainingArguments(output_dir=str(tmp_path), optim="adamw_nope")
    assert "layerwise_hf" not in str(err.value)  # any other name: transformers' error, untouched
    with pytest.raises(ValueError, match="uninstall\\(\\) was called"):
        TrainingArguments(output_dir=str(tmp_path)).set_optimizer(name="adamw_torch_layerwise")
    # A Trainer created after uninstall() is a stock one, with Trainer's error and how to fix it.
    args = LayerwiseTrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise", report_to="none")
    trainer = Trainer(model=tiny_llama(), args=args)
    assert type(trainer) is Trainer
    with pytest.raises(ValueError) as err:
        trainer.create_optimizer()
    assert str(err.value).startswith("Trainer cannot instantiate unsupported optimizer: adamw_torch_layerwise")
    assert "(or after uninstall())" in str(err.value) and "layerwise_hf.LayerwiseTrainer" in str(err.value)
    # transformers' own galore_*_layerwise names are stock Trainer's after uninstall(): their errors stay its own.
    galore = TrainingArguments(output_dir=str(tmp_path), optim="galore_adamw_layerwise", report_to="none")
    with pytest.raises(ValueError) as err:
        Trainer.get_optimizer_cls_and_kwargs(galore, tiny_llama())
    assert "layerwise_hf" not in str(err.value) and "optim_target_modules" in str(err.value)
    # Installing again replaces the originals, not the checks; uninstalling again leaves one check each.
    layerwise_hf.install()
    assert all(
        getattr(_unwrapped(vars(o)[n]), "_layerwise_original", None) is _unwrapped(before[(o, n)]) for o, n in before
    )
    layerwise_hf.uninstall()
    for o, n in before:
        check = vars(o)[n].__func__ if isinstance(vars(o)[n], staticmethod) else vars(o)[n]
        assert check._layerwise_hint and check._layerwise_original is _unwrapped(before[(o, n)])


def _unwrapped(method):
    function = method.__func__ if isinstance(method, staticmethod) else method
    return (
        getattr(function, "_layerwise_original", function) if getattr(function, "_layerwise_hint", False) else function
    )


@pytest.mark.parametrize(
    "owner, name, replacement, expected",
    [
        # The tested versions have (self) up to transformers 5.2, (self, model) from 5.3 (platform/compat.py): a third
        # parameter is neither.
        (Trainer, "create_optimizer", lambda self, model, extra: None, r"Trainer\.create_optimizer has parameters "),
        # Trainer._clip_grad_norm exists from transformers 5.3; before, training_step stands for a missing method.
        (
            Trainer,
            "_clip_grad_norm" if hasattr(Trainer, "_clip_grad_norm") else "training_step",
            None,
            r"Trainer\.\w+ is missing",
        ),
        (TrainingArguments, "set_optimizer", lambda self, name: None, r"TrainingArguments\.set_optimizer has"),
        ("accelerate", "backward", lambda self, loss, scaler: None, r"accelerate\.Accelerator\.backward has"),
    ],
)
def test_install_refuses_when_a_replaced_method_changed(monkeypatch, tmp_path, owner, name, replacement, expected):
    if owner == "accelerate":
        from accelerate import Accelerator as owner
    if replacement is None:
        monkeypatch.delattr(owner, name)
    else:
        monkeypatch.setattr(owner, name, replacement)
    try:
        with pytest.raises(patching.UnsupportedVersionError, match=expected) as err:
            layerwise_hf.install()
    finally:
        installed = patching.is_installed()
        if installed:  # a failed refusal must not leave the tests after this one patched
            layerwise_hf.uninstall()
    assert "tested with transformers 4.55 to 5.24, accelerate 1.10 to 1.15" in str(err.value)
    assert not installed
    with pytest.raises(ValueError, match="not a valid OptimizerNames"):
        TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise")


# ---------------------------------------------------------------- arguments


def test_parser_accepts_layerwise_names_from_command_line_yaml_and_json(installed, tmp_path):
    from trl import SFTConfig

    for cls in (TrainingArguments, SFTConfig):
        parser = HfArgumentParser(cls)
        argv = ["--output_dir", str(tmp_path), "--optim", "adamw_8bit_layerwise", "--use_cpu"]
        (args,) = parser.parse_args_into_dataclasses(argv)
        assert type(args) is cls and args.optim == "adamw_8bit_layerwise"
    (tmp_path / "a.yaml").write_text(f"output_dir: {tmp_path}\noptim: sgd_layerwise\n")
    values = {"output_dir": str(tmp_path), "optim": "adafactor_layerwise", "use_cpu": True}
    (tmp_path / "a.json").write_text(json.dumps(values))
    assert HfArgumentParser(TrainingArguments).parse_yaml_file(tmp_path / "a.yaml")[0].optim == "sgd_layerwise"
    assert HfArgumentParser(SFTConfig).parse_json_file(tmp_path / "a.json")[0].optim == "adafactor_layerwise"
    assert TrainingArguments(output_dir=str(tmp_path)).set_optimizer("lion_8bit_layerwise").optim == (
        "lion_8bit_layerwise"
    )
    # Other names behave as before; an unknown layer-wise name is refused with the valid ones.
    assert (
        HfArgumentParser(TrainingArguments)
        .parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--optim", "adamw_torch"])[0]
        .optim
        == "adamw_torch"
    )
    # As with LayerwiseTrainingArguments: the name is checked when the arguments are made, listing the valid ones.
    with pytest.raises(ValueError, match="adamw_nope_layerwise.*adamw_torch_layerwise"):
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--optim", "adamw_nope_layerwise"]
        )
    with pytest.raises(ValueError, match="not a valid OptimizerNames"):
        TrainingArguments(output_dir=str(tmp_path), optim="adamw_nope")


@pytest.mark.parametrize(
    "bad", [dict(gradient_accumulation_steps=0), dict(deepspeed={"zero_optimization": {"stage": 2}})], ids=str
)
def test_bad_arguments_refused_as_by_layerwise_training_arguments(installed, tmp_path, bad):
    kwargs = dict(output_dir=str(tmp_path), optim="adamw_torch_layerwise", use_cpu=True, **bad)
    with pytest.raises(ValueError) as explicit:
        LayerwiseTrainingArguments(**kwargs)
    with pytest.raises(ValueError) as patched:
        TrainingArguments(**kwargs)
    assert str(patched.value) == str(explicit.value)


def test_parser_refuses_layerwise_names_without_install(tmp_path, capsys):
    with pytest.raises(SystemExit):
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--optim", "adamw_8bit_layerwise"]
        )
    assert "invalid choice: 'adamw_8bit_layerwise'" in capsys.readouterr().err


# ---------------------------------------------------------------- Trainer


def test_other_optimizers_train_as_before(installed, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch", report_to="none")
    trainer = Trainer(model=tiny_llama(), args=args)
    assert type(trainer) is Trainer
    assert not isinstance(trainer, LayerwiseTrainerMixin)


def test_trainer_created_before_install_says_how_to_fix(tmp_path):
    args = LayerwiseTrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise", report_to="none")
    trainer = Trainer(model=tiny_llama(), args=args)
    layerwise_hf.install()
    try:
        with pytest.raises(ValueError) as err:
            trainer.create_optimizer()
    finally:
        layerwise_hf.uninstall()
    message = str(err.value)
    assert message.startswith("Trainer cannot instantiate unsupported optimizer: adamw_torch_layerwise")
    assert "created before layerwise_hf.install()" in message and "LayerwiseTrainer" in message


def test_run_clm_script_matches_explicit_classes_with_checkpoints_and_resume(installed, tmp_path):
    layerwise_hf.uninstall()
    explicit = explicit_run(tmp_path / "explicit")
    layerwise_hf.install()
    patched = run_clm_like.main(argv=clm_argv(tmp_path / "patched"))
    assert type(patched).__mro__[1] is LayerwiseTrainerMixin and patched.layerwise_optimizer is not None
    assert_params_equal(explicit.model, patched.model)
    for name in ("checkpoint-2", "checkpoint-4", "."):
        assert_same_files(tmp_path / "explicit" / name, tmp_path / "patched" / name)
    # Resume the patched run from its first checkpoint: the same weights as the uninterrupted explicit run.
    resumed = run_clm_like.main(
        argv=clm_argv(tmp_path / "resumed", "adamw_torch_layerwise", "--resume_from_checkpoint",
                      str(tmp_path / "patched" / "checkpoint-2"))
    )  # fmt: skip
    assert resumed.state.global_step == 4
    assert_params_equal(explicit.model, resumed.model)


def test_trainer_subclass_overriding_compute_loss_matches_explicit_subclass(installed, tmp_path):
    extra = ("--loss", "z_loss", "--save_strategy", "no")
    layerwise_hf.uninstall()
    explicit = explicit_run(tmp_path / "explicit", *extra)
    layerwise_hf.install()
    patched = run_clm_like.main(argv=clm_argv(tmp_path / "patched", "adamw_torch_layerwise", *extra))
    assert type(patched).__name__ == "ZLossTrainer" and isinstance(patched, LayerwiseTrainerMixin)
    assert_params_equal(explicit.model, patched.model)
    standard_loss = explicit_run(tmp_path / "standard_loss", "--save_strategy", "no").model
    assert not torch.equal(standard_loss.lm_head.weight, patched.model.lm_head.weight), "the override must matter"


# ---------------------------------------------------------------- the launcher


def launch(*argv, cwd=ROOT, timeout=600):
    cmd = [sys.executable, "-m", "layerwise_hf", *map(str, argv)]
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_launcher_runs_unchanged_script_like_explicit_classes(tmp_path):
    # --layerwise_clip (a launcher option, before the script) reaches the stock arguments the script makes.
    result = launch("--layerwise_clip", "previous", SCRIPT, *clm_argv(tmp_path / "launched"))
    assert result.returncode == 0, result.stderr[-4000:]
    explicit_run(tmp_path / "explicit", "--layerwise_clip", "previous")
    for name in ("checkpoint-2", "checkpoint-4", "."):
        assert_same_files(tmp_path / "explicit" / name, tmp_path / "launched" / name)
    # Not the default exact clipping: the same run clipped exactly ends elsewhere.
    explicit_run(tmp_path / "exact", "--save_strategy", "no")
    exact, launched = (load_file(tmp_path / d / "model.safetensors") for d in ("exact", "launched"))
    assert any(not torch.equal(exact[k], launched[k]) for k in exact)


def test_install_layerwise_clip_reaches_stock_arguments(tmp_path):
    layerwise_hf.install(layerwise_clip="previous")
    try:
        args = TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise", report_to="none")
        trainer = Trainer(model=tiny_llama(), args=args)
        assert (
            args.layerwise_clip == "previous" and trainer.create_optimizer().pipeline.clipper.mode.value == "previous"
        )
        explicit = LayerwiseTrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise")
        assert explicit.layerwise_clip == "exact", "the explicit class keeps its own field"
        with pytest.raises(ValueError, match="layerwise_clip"):
            layerwise_hf.install(layerwise_clip="sometimes")
    finally:
        layerwise_hf.uninstall()
    layerwise_hf.install()
    try:
        args = TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise", report_to="none")
        assert not hasattr(args, "layerwise_clip"), "uninstall() forgets the setting"
    finally:
        layerwise_hf.uninstall()


def test_install_layerwise_preflight_reaches_stock_arguments(tmp_path):
    from layerwise_hf.integrations.launcher import build_parser

    assert build_parser().parse_args(["--layerwise_preflight"]).layerwise_preflight is True
    assert build_parser().parse_args([]).layerwise_preflight is None, "unset: stock arguments get no field"
    layerwise_hf.install(layerwise_preflight=True)
    try:
        args = TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise", report_to="none")
        assert args.layerwise_preflight is True
        other = TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch", report_to="none")
        assert not hasattr(other, "layerwise_preflight"), "a standard optim trains exactly as before"
        with pytest.raises(ValueError, match="layerwise_preflight"):
            layerwise_hf.install(layerwise_preflight="yes")
    finally:
        layerwise_hf.uninstall()
    layerwise_hf.install()
    try:
        args = TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise", report_to="none")
        assert not hasattr(args, "layerwise_preflight"), "uninstall() forgets the setting"
    finally:
        layerwise_hf.uninstall()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["no/such/train.py", "--optim", "x"], "can't open file 'no/such/train.py'"),
        (["-m", "no_such_package_xyz.train"], "No module named 'no_such_package_xyz'"),
        (["-m", "json.no_such_module"], "No module named 'json.no_such_module'"),
        ([], "give the SCRIPT to run, or -m MODULE"),
        (["--layerwise_clip", "previous", "nope.py", "--optim", "x"], "can't open file 'nope.py'"),
    ],
)
def test_launcher_bad_input_exits_2_naming_it(argv, message, capsys):
    assert launcher_main(argv) == 2
    assert message in capsys.readouterr().err
    assert not patching.is_installed()


def test_launcher_bad_option_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        launcher_main(["--layerwise_clip", "sometimes", "train.py"])
    assert exit_.value.code == 2 and "invalid choice: 'sometimes'" in capsys.readouterr().err


def _console_script(tmp_path) -> dict:
    """An installed distribution (a dist-info on PYTHONPATH) whose console script `lw-test-cli` checks that install()
    is in effect, prints its argv and exits 3; and a Python script `lw-test-path` on PATH that does the same."""
    site = tmp_path / "site"
    (site / "lw_test_tool").mkdir(parents=True)
    (site / "lw_test_tool" / "__init__.py").write_text(
        "import sys\n"
        "def main():\n"
        "    from transformers import TrainingArguments\n"
        "    args = TrainingArguments(output_dir='o', optim='adamw_torch_layerwise', report_to='none')\n"
        "    print('argv', sys.argv, args.optim)\n"
        "    return 3\n"
    )
    info = site / "lw_test_tool-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lw-test-tool\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[console_scripts]\nlw-test-cli = lw_test_tool:main\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "lw-test-path"
    script.write_text("#!/usr/bin/env python3\nimport sys\nfrom lw_test_tool import main\nsys.exit(main())\n")
    script.chmod(0o755)
    return {
        **ENV,
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
        "PATH": f"{bin_dir}{os.pathsep}{ENV['PATH']}",
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lw-test-cli", "lw-test-path"], ids=["console-script", "on-path"])
def test_launcher_runs_a_command_by_name_with_install_in_effect(tmp_path, name):
    # As `python -m layerwise_hf llamafactory-cli train cfg.yaml`: a name that is no file, run in this process.
    env = _console_script(tmp_path)
    cmd = [sys.executable, "-m", "layerwise_hf", name, "train", "cfg.yaml"]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 3, result.stderr[-3000:]
    argv0 = name if name == "lw-test-cli" else str(tmp_path / "bin" / name)
    assert f"argv {[argv0, 'train', 'cfg.yaml']} adamw_torch_layerwise" in result.stdout


def test_launcher_runs_a_console_script_in_process(tmp_path, monkeypatch, capsys):
    env = _console_script(tmp_path)
    monkeypatch.syspath_prepend(env["PYTHONPATH"].split(os.pathsep)[0])
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    try:
        assert launcher_main(["lw-test-cli", "train", "cfg.yaml"]) == 3
    finally:
        layerwise_hf.uninstall()
    assert "argv ['lw-test-cli', 'train', 'cfg.yaml'] adamw_torch_layerwise" in capsys.readouterr().out


def test_find_command_prefers_the_installed_entry_point(tmp_path, monkeypatch):
    from layerwise_hf.integrations.launcher import find_command

    assert find_command("layerwise-hf").entry_point.value == "layerwise_hf.cli:main"
    assert find_command("no-such-command-xyz") is None
    assert find_command("./layerwise-hf") is None  # a path is a file or nothing


@pytest.mark.parametrize(
    "name, message",
    [
        ("no-such-command-xyz", "no installed console script or Python script on PATH has that name"),
        ("ls", "is not a Python script"),
    ],
)
def test_launcher_names_the_m_form_when_a_command_cannot_run(name, message, capsys):
    assert launcher_main([name, "train", "cfg.yaml"]) == 2
    err = capsys.readouterr().err
    assert message in err and "python -m layerwise_hf -m MODULE" in err, err
    assert not patching.is_installed()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes: Python 3.11 (3.10 prints the note)")
def test_launcher_option_after_the_script_is_noted_on_its_error(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("raise ValueError('unknown argument --layerwise_clip')\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        with pytest.raises(ValueError) as err:
            launcher_main([str(script), "--layerwise_clip=previous"])
    finally:
        layerwise_hf.uninstall()
    assert err.value.__notes__ == [
        f"python -m layerwise_hf: note: --layerwise_clip=previous came after {script}, so {script} got it; the "
        f"launcher's options go before the script: python -m layerwise_hf --layerwise_clip=previous {script} ..."
    ]


@pytest.mark.slow
def test_launcher_option_after_the_script_is_pointed_to(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "from transformers import HfArgumentParser, TrainingArguments\n"
        "HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()\n"
    )
    result = launch(script, "--output_dir", tmp_path / "out", "--layerwise_clip", "previous", cwd=tmp_path)
    assert result.returncode == 1
    assert "Some specified arguments are not used by the HfArgumentParser" in result.stderr  # the script's own error
    note = (
        f"python -m layerwise_hf: note: --layerwise_clip previous came after {script}, so {script} got it; the "
        f"launcher's options go before the script: python -m layerwise_hf --layerwise_clip previous {script} ..."
    )
    assert note in result.stderr, result.stderr[-2000:]


@pytest.mark.slow
def test_launcher_option_after_a_script_that_takes_it_says_nothing(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import sys\nassert sys.argv[1:] == ['--layerwise_clip', 'previous']\n")
    result = launch(script, "--layerwise_clip", "previous", cwd=tmp_path)
    assert result.returncode == 0 and "note:" not in result.stderr, result.stderr


def test_launcher_exit_status_from_the_command_line(tmp_path):
    result = launch(tmp_path / "missing.py")
    assert result.returncode == 2
    assert "missing.py" in result.stderr and "Traceback" not in result.stderr


# ---------------------------------------------------------------- TRL


def _sft_inputs(tmp_path):
    pytest.importorskip("trl")
    from test_trl import sft_dataset, tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    # trl 0.18's script gives a tokenizer without a chat template ChatML tokens, with embedding rows drawn before
    # anything seeds torch (a new draw in each process); the data is plain text, which no template changes.
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    tiny_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "data").mkdir()
    sft_dataset().to_json(tmp_path / "data" / "train.jsonl")
    return tmp_path / "model", tmp_path / "data"


SFT_RUN = dict(
    max_steps=3, per_device_train_batch_size=4, logging_steps=1, save_steps=2, report_to="none", use_cpu=True, seed=0,
    data_seed=0, disable_tqdm=True, max_length=32,
)  # fmt: skip


def test_trl_sft_script_through_launcher_matches_layerwise_sft_trainer(tmp_path, monkeypatch):
    import trl.scripts.sft as script
    from datasets import load_dataset

    from layerwise_hf.integrations.trl import LayerwiseSFTConfig, LayerwiseSFTTrainer

    model, data = _sft_inputs(tmp_path)
    options = [x for k, v in SFT_RUN.items() for x in (f"--{k}", str(v).lower() if v is True else str(v))]
    argv = [
        "--model_name_or_path", str(model), "--dataset_name", str(data), "--optim", "adamw_torch_layerwise", *options,
    ]  # fmt: skip
    result = launch("-m", "trl.scripts.sft", *argv, "--output_dir", tmp_path / "launched")
    assert result.returncode == 0, result.stderr[-4000:]

    # What trl/scripts/sft.py does with these arguments, with the explicit classes.
    if "model_init_kwargs" in inspect.getsource(script.main):  # trl 1.x: SFTTrainer loads the model by name
        args = LayerwiseSFTConfig(output_dir=str(tmp_path / "explicit"), optim="adamw_torch_layerwise", **SFT_RUN)
        args.model_init_kwargs = dict(
            revision="main", trust_remote_code=False, attn_implementation=None, dtype="float32"
        )
        dataset = load_dataset(str(data))["train"]
        trainer = LayerwiseSFTTrainer(model=str(model), args=args, train_dataset=dataset)
        trainer.train()
        trainer.save_model(args.output_dir)
    else:  # trl 0.18: the script loads the model and tokenizer itself (and may add a chat format): run its main()
        from trl import ModelConfig, ScriptArguments, TrlParser

        monkeypatch.setattr(script, "SFTTrainer", LayerwiseSFTTrainer)
        parser = TrlParser((ScriptArguments, LayerwiseSFTConfig, ModelConfig))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the launched process (OMP_NUM_THREADS=1), whatever the shell gave the tests
        try:
            script.main(*parser.parse_args_into_dataclasses([*argv, "--output_dir", str(tmp_path / "explicit")]))
        finally:
            torch.set_num_threads(threads)
    for name in ("checkpoint-2", "checkpoint-3", "."):
        assert_same_files(tmp_path / "explicit" / name, tmp_path / "launched" / name)


# ---------------------------------------------------------------- accelerate launch (2 gloo ranks)


@pytest.mark.slow
def test_accelerate_launch_through_launcher_matches_explicit_classes(tmp_path):
    from test_distributed import free_port

    def accelerate(*argv):
        env = {**ENV, "ACCELERATE_USE_CPU": "true", "PYTHONPATH": str(ROOT)}
        config = str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml")
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config]
        cmd += ["--main_process_port", str(free_port()), *argv]
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]

    accelerate("-m", "layerwise_hf", str(SCRIPT), *clm_argv(tmp_path / "launched"))
    explicit = tmp_path / "explicit.py"
    explicit.write_text(
        "import runpy, sys\nfrom layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments\n"
        f"runpy.run_path({str(SCRIPT)!r})['main'](LayerwiseTrainer, LayerwiseTrainingArguments)\n"
    )
    accelerate(str(explicit), *clm_argv(tmp_path / "explicit"))
    # Two ranks of 4 sequences a step: 4 steps are half of the 64 sequences (a quarter on one process).
    assert json.loads((tmp_path / "launched" / "trainer_state.json").read_text())["epoch"] == 0.5
    for name in ("checkpoint-2", "checkpoint-4", "."):
        assert_same_files(tmp_path / "explicit" / name, tmp_path / "launched" / name)
