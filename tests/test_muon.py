"""`optim="muon_layerwise"`: Muon for the hidden layers' matrices, AdamW elsewhere, equal to a hand-built
whole-model Muon + AdamW pair in a stock Trainer."""

import pytest
import torch
from helpers import TokenDataset, assert_params_equal, clone, logged, tiny_llama, training_args
from transformers import Trainer

from layerwise_hf import LayerwiseTrainer, build_layerwise_optimizer


class MuonAdamWPair(torch.optim.Optimizer):
    """What a Trainer user has to build by hand: two whole-model optimizers behind one, sharing param groups (so
    Trainer's scheduler drives both)."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.optimizers = []
        super().__init__([g for o in (muon, adamw) for g in o.param_groups], {"lr": adamw.defaults["lr"]})
        self.optimizers = [muon, adamw]

    # Optimizer.__init__ and load_state_dict (Accelerate's prepare calls it) copy the group dicts: always hand out
    # the inner optimizers' own, which they read when they step.
    @property
    def param_groups(self):
        return [g for o in self.optimizers for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, value):
        pass

    @torch.no_grad()
    def step(self, closure=None):
        for optimizer in self.optimizers:
            optimizer.step()


def hand_built_pair(model, args, muon_lr=None, adjust_lr_fn="match_rms_adamw"):
    decay = set(Trainer.get_decay_parameter_names(None, model))
    excluded = {id(model.model.embed_tokens.weight), id(model.lm_head.weight)}
    muon, adamw_decay, adamw_rest = [], [], []
    for n, p in model.named_parameters():
        if p.ndim == 2 and id(p) not in excluded:
            muon.append(p)
        else:
            (adamw_decay if n in decay else adamw_rest).append(p)
    assert all(n in decay for n, p in model.named_parameters() if any(p is q for q in muon))
    return MuonAdamWPair(
        torch.optim.Muon(
            [{"params": muon, "weight_decay": args.weight_decay}],
            lr=muon_lr or args.learning_rate,
            momentum=0.95,
            nesterov=True,
            adjust_lr_fn=adjust_lr_fn,
        ),
        torch.optim.AdamW(
            [{"params": adamw_decay, "weight_decay": args.weight_decay}, {"params": adamw_rest, "weight_decay": 0.0}],
            lr=args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
        ),
    )


@pytest.mark.parametrize(
    ("ga", "optim_args", "muon_lr", "adjust"),
    [
        (1, None, None, "match_rms_adamw"),
        (2, None, None, "match_rms_adamw"),
        (1, "adjust_lr_fn=original,muon_lr=0.02", 0.02, "original"),
    ],
)
def test_muon_layerwise_matches_a_hand_built_pair(tmp_path, ga, optim_args, muon_lr, adjust):
    base = tiny_llama()
    kwargs = dict(gradient_accumulation_steps=ga, max_grad_norm=1.0, optim_args=optim_args)
    args = training_args(tmp_path / "l", "muon_layerwise", **kwargs)
    layerwise = LayerwiseTrainer(model=clone(base), args=args, train_dataset=TokenDataset())
    layerwise.train()
    std_model = clone(base)
    std_args = training_args(tmp_path / "s", "adamw_torch", **{**kwargs, "optim_args": None})
    pair = hand_built_pair(std_model, std_args, muon_lr, adjust)
    standard = Trainer(model=std_model, args=std_args, train_dataset=TokenDataset(), optimizers=(pair, None))
    standard.train()
    assert_params_equal(standard.model, layerwise.model)
    assert logged(standard, "grad_norm") == logged(layerwise, "grad_norm")
    kinds = {type(i).__name__ for i in layerwise.layerwise_optimizer.inner}
    assert kinds == {"Muon", "AdamW"}
    if muon_lr:
        # Two learning rates: both are logged, each named.
        muon_lrs, adamw_lrs = logged(layerwise, "learning_rate_muon"), logged(layerwise, "learning_rate_adamw")
        assert len(muon_lrs) == len(adamw_lrs) == len(logged(layerwise, "learning_rate"))
        assert any(adamw_lrs) and all(
            m * args.learning_rate == pytest.approx(a * 0.02) for m, a in zip(muon_lrs, adamw_lrs)
        )
        assert adamw_lrs == logged(layerwise, "learning_rate")


def test_muon_layerwise_refuses_unknown_settings(tmp_path):
    args = training_args(tmp_path, "muon_layerwise", optim_args="muon_beta=0.9")
    with pytest.raises(ValueError, match="'muon_beta' is not a muon_layerwise setting; choose from adjust_lr_fn"):
        build_layerwise_optimizer(tiny_llama(), args)
