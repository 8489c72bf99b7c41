"""GaLore through this plugin: galore_*_layerwise trains exactly like the standard GaLore optimizer, the scheduler
drives every layer's lr, weight decay follows Trainer's split, and checkpoints (projectors included) resume exactly."""

import importlib.util
import sys

import pytest
import torch
from helpers import TokenDataset, assert_params_equal, clone, logged, tiny_llama, train, training_args
from transformers import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments

from layerwise_hf import (
    LayerwiseTrainer,
    LayerwiseTrainingArguments,
    build_layerwise_optimizer,
    list_layerwise_optimizers,
    unwrap_layerwise_optimizer,
)
from layerwise_hf.bases.registry import (
    TRANSFORMERS_LAYERWISE_NAMES,
    describe_layerwise_optimizers,
    parse_optim_name,
    register_layerwise_optimizer,
)
from layerwise_hf.platform.compat import trainer_logs_grad_norm

pytest.importorskip("galore_torch")

GALORE_NAMES = ["galore_adamw_layerwise", "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise"]
TARGETS = ["attn", "mlp"]
# Small rank, and a new projection every 2 steps, so projections are recomputed (and carried over) during a run.
GALORE = dict(optim_target_modules=TARGETS, optim_args="rank=4,update_proj_gap=2,scale=0.5")


APOLLO = pytest.param(
    "apollo_adamw_layerwise",
    marks=pytest.mark.skipif(importlib.util.find_spec("apollo_torch") is None, reason="needs apollo-torch"),
)


def galore_args(tmp_path, optim, **overrides):
    return training_args(tmp_path, optim, **{**GALORE, **overrides})


@pytest.fixture
def standard_galore_8bit(monkeypatch):
    """What the standard GaLoreAdamW8bit needs to be a fair reference in this process."""
    # galore_torch's AdamW8bit.step calls torch.cuda.synchronize() unconditionally: without this it cannot run on
    # CPU at all (the layer-wise class handles it itself).
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    # A fresh process-wide bitsandbytes manager: earlier 8-bit Trainer runs in this process leave (group, index)
    # overrides there (Trainer's embedding rule) that the standard optimizer would apply to whatever parameter sits
    # at that index. The layer-wise optimizers use private managers and never see them.
    from bitsandbytes.optim import GlobalOptimManager

    fresh = GlobalOptimManager.__new__(GlobalOptimManager)
    fresh.initialize()
    monkeypatch.setattr(GlobalOptimManager, "_instance", fresh)


def model_for(optim):
    # bitsandbytes quantizes tensors of >= 4096 elements: large enough that the 8-bit path runs for the embedding.
    if "8bit" in optim:
        return tiny_llama(vocab=256, hidden=64), TokenDataset(vocab=256)
    return tiny_llama(), TokenDataset()


class Recorder:
    """What each inner optimizer reads when it steps: lr and weight decay per step, and one layer's projections."""

    def __init__(self, trainer, watched: int):
        self.trainer = trainer
        self.watched = watched
        self.lr: dict[int, set[float]] = {}
        self.weight_decay: dict[str, float] = {}
        self.projections: list[torch.Tensor] = []

    def pre(self, index, name):
        def hook(optimizer, args, kwargs):
            step = self.trainer.state.global_step + 1
            group = optimizer.param_groups[0]
            self.lr.setdefault(step, set()).add(group["lr"])
            self.weight_decay[name] = group["weight_decay"]

        return hook

    def post(self, optimizer, args, kwargs):
        (param,) = optimizer.param_groups[0]["params"]
        self.projections.append(optimizer.state[param]["projector"].ortho_matrix.clone())


class RecordingTrainer(LayerwiseTrainer):
    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        watched = optimizer.names.index("model.layers.0.mlp.up_proj.weight")
        self.recorder = Recorder(self, watched)
        for i, (name, inner) in enumerate(zip(optimizer.names, optimizer.inner)):
            inner.register_step_pre_hook(self.recorder.pre(i, name))
        optimizer.inner[watched].register_step_post_hook(self.recorder.post)
        return optimizer


class GroupedGaLoreTrainer(Trainer):
    """
    The standard (not layer-wise) GaLore optimizer exactly as Trainer builds it (same class, target selection and
    low-rank groups), with Trainer's decay / no-decay split applied inside those groups. Stock Trainer gives GaLore
    groups no weight decay key, so the class default applies (0.0, or 1e-2 for GaLoreAdamW8bit).
    """

    def create_optimizer(self, model=None):
        model = self.model if model is None else model
        optimizer_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
        groups = kwargs.pop("params")
        decay = set(self.get_decay_parameter_names(model))
        names = {id(p): n for n, p in model.named_parameters()}
        split = []
        for group in groups:
            for decays, weight_decay in ((True, self.args.weight_decay), (False, 0.0)):
                params = [p for p in group["params"] if p.requires_grad and (names[id(p)] in decay) == decays]
                if params:
                    split.append({**group, "params": params, "weight_decay": weight_decay})
        self.optimizer = optimizer_cls(split, **kwargs)
        return self.optimizer


def transformers_targets(model, **overrides):
    """The parameters transformers' galore_adamw projects, and its kwargs, straight from Trainer."""
    args = TrainingArguments(output_dir="unused", optim="galore_adamw", report_to="none", **overrides)
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    plain, projected = kwargs.pop("params")
    ids = {id(p) for p in projected["params"]}
    return (
        {n for n, p in model.named_parameters() if id(p) in ids},
        {k: v for k, v in projected.items() if k != "params"},
        kwargs,
    )


# ---- parity ----


@pytest.mark.parametrize("ga,max_grad_norm", [(1, 0.0), (2, 0.0), (1, 1.0)], ids=["ga1", "ga2", "ga1-exact-clip"])
def test_matches_stock_galore_adamw(tmp_path, ga, max_grad_norm):
    # Stock Trainer's galore_adamw applies no weight decay (GaLoreAdamW's default): the same here with 0.0.
    model = tiny_llama()
    common = dict(weight_decay=0.0, gradient_accumulation_steps=ga, max_grad_norm=max_grad_norm)
    standard = train(clone(model), galore_args(tmp_path / "s", "galore_adamw", **common), trainer_cls=Trainer)
    layerwise = train(
        clone(model), galore_args(tmp_path / "l", "galore_adamw_layerwise", **common), trainer_cls=RecordingTrainer
    )

    assert_params_equal(standard.model, layerwise.model)
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), layerwise.model.parameters()))
    assert moved > 1e-4

    grad_norms = logged(standard, "grad_norm")
    assert logged(layerwise, "grad_norm") == grad_norms
    if trainer_logs_grad_norm(max_grad_norm):
        assert len(grad_norms) == len(logged(standard, "learning_rate")) and min(grad_norms) > 0
    lrs = logged(standard, "learning_rate")
    assert logged(layerwise, "learning_rate") == lrs
    assert len(set(lrs)) > 3, "warmup + cosine should move the lr"
    # The lr every inner optimizer applied at each step is the scheduled one (transformers' own
    # galore_adamw_layerwise keeps the initial lr for every step).
    recorder = layerwise.recorder
    assert [recorder.lr[step] for step in sorted(recorder.lr)] == [{lr} for lr in lrs]
    # The projection was recomputed during the run (steps 1, 3, 5 with update_proj_gap=2), so it was exercised.
    distinct = {tuple(m.flatten().tolist()) for m in recorder.projections}
    assert len(recorder.projections) == 6 and len(distinct) == 3


@pytest.mark.parametrize("ga", [1, 2])
@pytest.mark.parametrize("optim", GALORE_NAMES)
def test_matches_standard_galore_with_weight_decay_split(tmp_path, optim, ga, standard_galore_8bit):
    model, dataset = model_for(optim)
    base = optim.removesuffix("_layerwise")
    standard = train(
        clone(model),
        galore_args(tmp_path / "s", base, gradient_accumulation_steps=ga),
        dataset=dataset,
        trainer_cls=GroupedGaLoreTrainer,
    )
    layerwise = train(
        clone(model),
        galore_args(tmp_path / "l", optim, gradient_accumulation_steps=ga),
        dataset=dataset,
        trainer_cls=RecordingTrainer,
    )

    assert_params_equal(standard.model, layerwise.model)
    assert logged(layerwise, "grad_norm") == logged(standard, "grad_norm")
    assert logged(layerwise, "learning_rate") == logged(standard, "learning_rate")

    decay = set(Trainer.get_decay_parameter_names(None, model))
    applied = layerwise.recorder.weight_decay
    assert applied == {n: 0.1 if n in decay else 0.0 for n in layerwise.layerwise_optimizer.names}
    assert {n for n in applied if n.endswith("norm.weight")} and not any(applied[n] for n in applied if "norm" in n)

    optimizer = layerwise.layerwise_optimizer
    projected = {n for n, g in zip(optimizer.names, optimizer.param_groups) if "rank" in g}
    expected, group_kwargs, _ = transformers_targets(model, **GALORE)
    assert projected == expected
    assert all({k: g[k] for k in group_kwargs} == group_kwargs for g in optimizer.param_groups if "rank" in g)
    if "8bit" in optim:
        # The 8-bit path really ran: the (non-projected) embedding keeps quantized state.
        embed = optimizer.names.index("model.embed_tokens.weight")
        state = optimizer.inner[embed].state[optimizer.param_groups[embed]["params"][0]]
        assert state["state1"].dtype == torch.uint8


# galore_adamw_8bit is not here: stock Trainer gives GaLoreAdamW8bit its class default weight_decay=1e-2 for every
# parameter whatever `weight_decay` says; the weight-decay split test above compares it at GA 1 and 2.
STOCK_LOW_RANK_NAMES = ["galore_adamw_layerwise", "galore_adafactor_layerwise", APOLLO]


@pytest.mark.parametrize("ga", [1, 2])
@pytest.mark.parametrize("optim", STOCK_LOW_RANK_NAMES)
def test_layerwise_forms_match_stock_trainer(tmp_path, optim, ga):
    # The stock standard forms as a user runs them, on both sides: stock Trainer gives them no weight decay, so
    # weight_decay=0 (with weight decay the layer-wise forms apply Trainer's split, see above).
    model, dataset = model_for(optim)
    common = dict(weight_decay=0.0, gradient_accumulation_steps=ga)
    base = optim.removesuffix("_layerwise")
    standard = train(clone(model), galore_args(tmp_path / "s", base, **common), dataset=dataset, trainer_cls=Trainer)
    layerwise = train(clone(model), galore_args(tmp_path / "l", optim, **common), dataset=dataset)
    assert_params_equal(standard.model, layerwise.model)
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), layerwise.model.parameters()))
    assert moved > 1e-4
    assert logged(layerwise, "grad_norm") == logged(standard, "grad_norm")


@pytest.mark.skipif(importlib.util.find_spec("apollo_torch") is None, reason="needs apollo-torch")
def test_apollo_projectors_get_the_whole_model_seeds(tmp_path):
    # apollo-torch seeds each random projector with the parameter's position in the optimizer: every per-parameter
    # optimizer would get 1, and every projected tensor the same projection.
    model = tiny_llama()
    args = galore_args(tmp_path, "apollo_adamw")
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    standard = optimizer_cls(kwargs.pop("params"), **kwargs)
    expected = {n: standard.state[p]["seed"] for n, p in model.named_parameters()}
    layerwise = build_layerwise_optimizer(model, galore_args(tmp_path, "apollo_adamw_layerwise"))
    seeds = {
        n: inner.state[p]["seed"] for (n, p), inner in zip(zip(layerwise.names, layerwise.params), layerwise.inner)
    }
    assert seeds == expected
    assert len(set(seeds.values())) == len(seeds)


@pytest.mark.parametrize("mode", ["previous", "per_param", "off"])
def test_other_clipping_modes_run(tmp_path, mode):
    class Modes(TrainerCallback):
        seen = set()

        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            self.seen.add(unwrap_layerwise_optimizer(optimizer).pipeline.clipper.mode.value)

    trainer = train(
        tiny_llama(),
        galore_args(tmp_path, "galore_adamw_layerwise", max_grad_norm=0.5, layerwise_clip=mode),
        callbacks=[Modes()],
    )
    assert min(logged(trainer, "grad_norm")) > 0
    assert Modes.seen == {mode}


# ---- target selection ----


@pytest.mark.parametrize(
    "targets,tie",
    [
        (["attn", "mlp"], False),
        (["q_proj", "model.layers.1.mlp.down_proj"], False),
        (r".*\.(k|v)_proj", False),
        ("all-linear", False),
        ("all_linear", True),
    ],
    ids=["substrings", "names", "regex", "all-linear", "all-linear-tied"],
)
@pytest.mark.parametrize("optim", ["galore_adamw_layerwise", "galore_adafactor_layerwise"])
def test_targets_and_settings_are_transformers_own(tmp_path, targets, tie, optim):
    model = tiny_llama(tie=tie)
    args = training_args(tmp_path, optim, optim_target_modules=targets, optim_args="rank=3,proj_type=left")
    optimizer = build_layerwise_optimizer(model, args)
    expected, group_kwargs, kwargs = transformers_targets(
        model, optim_target_modules=targets, optim_args="rank=3,proj_type=left", learning_rate=args.learning_rate
    )
    if "adafactor" in optim:
        kwargs.update({"scale_parameter": False, "relative_step": False})  # what galore_adafactor adds
    projected = {n for n, g in zip(optimizer.names, optimizer.param_groups) if "rank" in g}
    assert projected == expected and projected
    assert group_kwargs == {"rank": 3, "update_proj_gap": 200, "scale": 0.25, "proj_type": "left"}
    for inner, group in zip(optimizer.inner, optimizer.param_groups):
        assert {k: group[k] for k in group_kwargs} == group_kwargs if "rank" in group else "rank" not in group
        assert all(inner.defaults[k] == v for k, v in kwargs.items())
    # Everything trainable has an optimizer, projected or not, all of the same class.
    assert optimizer.names == [n for n, p in model.named_parameters() if p.requires_grad]
    assert len({type(inner) for inner in optimizer.inner}) == 1


def test_frozen_parameters_get_no_optimizer(tmp_path):
    model = tiny_llama()
    for name, p in model.named_parameters():
        p.requires_grad_("layers.1" in name)
    optimizer = build_layerwise_optimizer(model, galore_args(tmp_path, "galore_adamw_layerwise"))
    assert optimizer.names == [n for n, p in model.named_parameters() if "layers.1" in n]


# ---- checkpoints ----


@pytest.mark.parametrize("optim", [*GALORE_NAMES, APOLLO])
def test_resume_equals_uninterrupted(tmp_path, optim):
    model, dataset = model_for(optim)
    # Saved after step 3: the projection computed at step 3 is still in use at step 4, so it must come back exactly.
    kwargs = dict(max_steps=6, save_strategy="steps", save_steps=3)
    full = train(clone(model), galore_args(tmp_path / "full", optim, **kwargs), dataset=dataset)

    checkpoint = tmp_path / "full" / "checkpoint-3"
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    names = [g["name"] for g in state["param_groups"]]
    assert names == full.layerwise_optimizer.names
    assert sorted(state["state"]) == list(range(len(names)))
    projected = [i for i, g in enumerate(state["param_groups"]) if "rank" in g]
    assert projected
    for i in projected:
        projector = state["state"][i]["projector"]
        assert isinstance(projector["ortho_matrix"], torch.Tensor)
        assert projector["rank"] == 4 and projector["update_proj_gap"] == 2 and projector["scale"] == 0.5
        assert projector["proj_type"] == "std"

    resumed = train(
        clone(model),
        galore_args(tmp_path / "resumed", optim, **kwargs),
        dataset=dataset,
        resume_from_checkpoint=str(checkpoint),
    )
    assert resumed.state.global_step == 6
    assert_params_equal(full.model, resumed.model)
    final_full = torch.load(tmp_path / "full" / "checkpoint-6" / "optimizer.pt", weights_only=True)
    final_resumed = torch.load(tmp_path / "resumed" / "checkpoint-6" / "optimizer.pt", weights_only=True)
    _assert_states_equal(final_full["state"], final_resumed["state"])


def _assert_states_equal(a, b, where="state"):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_states_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_states_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "right", "left", "full"])
def test_projector_round_trip(tmp_path, proj_type):
    from galore_torch.galore_projector import GaLoreProjector

    from layerwise_hf.bases.galore import optimizer_class

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(12, 8))
    group = {"params": [param], "rank": 2, "update_proj_gap": 3, "scale": 0.5, "proj_type": proj_type}
    optimizer = optimizer_class("galore_adamw")([group], lr=1e-2, no_deprecation_warning=True)
    param.grad = torch.randn_like(param)
    optimizer.step()

    path = tmp_path / "opt.pt"
    torch.save(optimizer.state_dict(), path)
    # state_dict() must not replace the live projector.
    assert isinstance(optimizer.state[param]["projector"], GaLoreProjector)

    twin_param = torch.nn.Parameter(param.detach().clone())
    twin = optimizer_class("galore_adamw")(
        [{**group, "params": [twin_param], "rank": 7}], lr=1.0, no_deprecation_warning=True
    )
    twin.load_state_dict(torch.load(path, weights_only=True))
    original, loaded = optimizer.state[param]["projector"], twin.state[twin_param]["projector"]
    assert type(loaded) is GaLoreProjector
    assert vars(loaded).keys() == vars(original).keys()
    for key, value in vars(original).items():
        _assert_states_equal(value, getattr(loaded, key), key)
    assert twin.param_groups[0]["rank"] == 2 and twin.param_groups[0]["lr"] == 1e-2

    for _ in range(4):  # across a projection update (update_proj_gap=3)
        grad = torch.randn_like(param)
        param.grad, twin_param.grad = grad.clone(), grad.clone()
        optimizer.step()
        twin.step()
    assert torch.equal(param, twin_param)


@pytest.mark.parametrize("base", ["galore_adamw", "galore_adamw_8bit", "galore_adafactor"])
def test_step_hooks_run_once(base, standard_galore_8bit):
    import galore_torch

    from layerwise_hf.bases.galore import LOW_RANK_BASES, optimizer_class

    kwargs = {"lr": 1e-2, **({"relative_step": False} if base == "galore_adafactor" else {})}
    # An upstream instance first: torch then wraps the upstream class's step with the hook runner as well.
    getattr(galore_torch, LOW_RANK_BASES[base][1])([torch.nn.Parameter(torch.zeros(2, 2))], **kwargs)
    param = torch.nn.Parameter(torch.randn(8, 8))
    group = {"params": [param], "rank": 2, "update_proj_gap": 1, "scale": 1.0, "proj_type": "std"}
    optimizer = optimizer_class(base)([group], **kwargs)
    calls = []
    optimizer.register_step_pre_hook(lambda *args: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *args: calls.append("post"))
    param.grad = torch.randn_like(param)
    optimizer.step()
    assert calls == ["pre", "post"]


def test_unsaveable_state_is_refused_at_save():
    from layerwise_hf.bases.galore import optimizer_class

    param = torch.nn.Parameter(torch.randn(4, 4))
    optimizer = optimizer_class("galore_adamw")([param], lr=1e-2, no_deprecation_warning=True)
    optimizer.state[param]["odd"] = object()
    with pytest.raises(TypeError, match="cannot save a builtins.object"):
        optimizer.state_dict()


# ---- names, arguments, errors ----


def test_names_are_served_by_this_plugin(tmp_path):
    for name in [*GALORE_NAMES, "apollo_adamw_layerwise"]:
        assert name in list_layerwise_optimizers()
        assert parse_optim_name(name) == name.removesuffix("_layerwise")
    assert TRANSFORMERS_LAYERWISE_NAMES == ()
    rows = {name: (base, package) for name, base, package in describe_layerwise_optimizers()}
    assert rows["galore_adamw_layerwise"] == ("galore_adamw", "galore-torch")
    assert rows["galore_adamw_8bit_layerwise"] == ("galore_adamw_8bit", "galore-torch")
    assert rows["galore_adafactor_layerwise"] == ("galore_adafactor", "galore-torch")
    assert rows["apollo_adamw_layerwise"] == ("apollo_adamw", "apollo-torch")
    with pytest.raises(ValueError, match="built-in"):
        register_layerwise_optimizer("galore_adamw_layerwise", lambda lp, args: None)


def test_python_and_cli_arguments(tmp_path):
    args = LayerwiseTrainingArguments(
        output_dir=str(tmp_path), optim="galore_adamw_layerwise", optim_target_modules=TARGETS, report_to="none"
    )
    assert args.optim == "galore_adamw_layerwise" and args.is_layerwise
    parser = HfArgumentParser(LayerwiseTrainingArguments)
    # On a command line optim_target_modules is one string (TrainingArguments declares it `str | list[str]`): a
    # regex or "all-linear". Lists come from config files.
    (cli,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--optim",
            "galore_adamw_8bit_layerwise",
            "--optim_target_modules",
            r".*\.(self_attn|mlp)\..*",
            "--optim_args",
            "rank=4,update_proj_gap=2",
            "--report_to",
            "none",
        ]
    )
    assert cli.optim == "galore_adamw_8bit_layerwise" and cli.is_layerwise
    (from_file,) = parser.parse_dict(
        {"output_dir": str(tmp_path), "optim": "galore_adamw_layerwise", "optim_target_modules": TARGETS}
    )
    assert from_file.is_layerwise and from_file.optim_target_modules == TARGETS
    model = tiny_llama()
    projected = [
        {n for n, g in zip(o.names, o.param_groups) if "rank" in g}
        for o in (build_layerwise_optimizer(model, cli), build_layerwise_optimizer(model, from_file))
    ]
    assert projected[0] == projected[1] and len(projected[0]) == 14
    assert args.set_optimizer("galore_adafactor_layerwise").optim == "galore_adafactor_layerwise"

    trainer = LayerwiseTrainer(model=tiny_llama(), args=galore_args(tmp_path, "galore_adamw_layerwise"))
    optimizer = trainer.create_optimizer()
    assert trainer.layerwise_optimizer is optimizer
    assert {type(inner).__qualname__ for inner in optimizer.inner} == {"GaLoreAdamW"}
    assert type(optimizer.inner[0]).__module__ == "layerwise_hf.bases.galore"


@pytest.mark.parametrize("optim", GALORE_NAMES)
def test_missing_target_modules_is_transformers_error(tmp_path, optim):
    model = tiny_llama()
    with pytest.raises(ValueError) as theirs:
        Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(output_dir=str(tmp_path), optim=optim), model)
    args = training_args(tmp_path, optim)  # no optim_target_modules
    with pytest.raises(ValueError, match=r"define `optim_target_modules` to use " + optim) as ours:
        train(model, args)
    # transformers' own text, with the name as the user wrote it instead of the enum's repr.
    assert str(ours.value) == str(theirs.value).replace(f"OptimizerNames.{optim.upper()}", optim)


def test_targets_that_match_nothing_or_no_model(tmp_path):
    from layerwise_hf.bases.registry import resolve_factory

    args = training_args(tmp_path, "galore_adamw_layerwise", optim_target_modules=["no_such_module"])
    with pytest.raises(
        ValueError, match=r"No target modules found for galore_adamw_layerwise \(\['no_such_module'\]\)"
    ):
        build_layerwise_optimizer(tiny_llama(), args)
    with pytest.raises(ValueError, match="pass a model to initialize galore_adamw_layerwise"):
        resolve_factory(galore_args(tmp_path, "galore_adamw_layerwise"))


def test_apollo_without_its_package_names_it(tmp_path, monkeypatch):
    # Runs whether or not apollo-torch is installed (the test extras install it): the lookup is made to miss.
    import layerwise_hf.bases.galore as galore

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "apollo_torch" else find_spec(name, *a)
    )
    monkeypatch.setattr(galore, "_CLASSES", {k: v for k, v in galore._CLASSES.items() if k != "apollo_adamw"})
    args = galore_args(tmp_path, "apollo_adamw_layerwise")
    assert args.is_layerwise
    with pytest.raises(ImportError, match="pip install apollo-torch"):
        build_layerwise_optimizer(tiny_llama(), args)


def test_fsdp2_is_refused(tmp_path):
    from layerwise_hf.optim.optimizer import check_fsdp2_supported

    optimizer = build_layerwise_optimizer(tiny_llama(), galore_args(tmp_path, "galore_adamw_layerwise"))
    with pytest.raises(ValueError, match="cannot step FSDP2 shards"):
        check_fsdp2_supported(optimizer)


def test_8bit_runs_without_cuda(tmp_path):
    # No fixture here: the layer-wise class must run where galore_torch's own AdamW8bit cannot.
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    model, dataset = model_for("galore_adamw_8bit_layerwise")
    trainer = train(model, galore_args(tmp_path, "galore_adamw_8bit_layerwise", max_steps=2), dataset=dataset)
    assert trainer.state.global_step == 2
    assert torch.cuda.synchronize.__module__ == "torch.cuda"  # restored after each step


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
