"""A forward with side effects under the norm pass's rerun (layerwise_hf/optim/norm_pass.py): the model sees one
forward per micro-batch, as with stock Trainer, at Trainer's default max_grad_norm=1.0 and layerwise_norm_pass="auto".

The model of transformers' own `test_resume_batch_order` records each batch's indices by replacing a buffer in
`forward` (`self.data_order = torch.cat([self.data_order, ids])`); the others count calls in a plain attribute, keep
router-like statistics in a plain tensor changed in place, or collect statistics in a forward hook."""

import pytest
import torch
from helpers import assert_params_equal
from transformers import Trainer, TrainingArguments

from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments
from layerwise_hf.optim.norm_pass import ForwardState, NormPass, rerun_repeats

WIDTH = 16


class RecordingModel(torch.nn.Module):
    """Gradients (16 x 16 weights) outweigh activations (2 x 16 inputs): `auto` chooses `rerun` at max_grad_norm=1."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.register_buffer("data_order", torch.empty(0, dtype=torch.long))
        self.calls = 0  # a plain attribute counter
        self.load = torch.zeros(WIDTH)  # statistics kept outside buffers, changed in place

    def forward(self, input_x, labels, ids):
        self.data_order = torch.cat([self.data_order, ids])  # the peer test's line: a new tensor each call
        self.calls += 1
        self.load += (input_x > 0).sum(0)
        loss = torch.nn.functional.mse_loss(self.linear(input_x), labels)
        return {"loss": loss}


class Batches(torch.utils.data.Dataset):
    def __init__(self, n: int = 16):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, WIDTH, generator=g)
        self.y = torch.randn(n, WIDTH, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_x": self.x[i], "labels": self.y[i], "ids": torch.tensor(i)}


def run(tmp_path, layerwise: bool, hook: bool = False):
    model = RecordingModel()
    seen = []
    if hook:
        model.linear.register_forward_hook(lambda module, args, output: seen.append(output.detach().mean().item()))
    cls, args_cls = (LayerwiseTrainer, LayerwiseTrainingArguments) if layerwise else (Trainer, TrainingArguments)
    args = args_cls(
        output_dir=str(tmp_path / ("layerwise" if layerwise else "stock")),
        optim="sgd_layerwise" if layerwise else "sgd",
        learning_rate=0.1,
        per_device_train_batch_size=2,
        max_steps=6,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        seed=3,
    )  # Trainer's default max_grad_norm=1.0 (exact clipping), layerwise_norm_pass="auto"
    trainer = cls(model=model, args=args, train_dataset=Batches())
    trainer.train()
    return trainer, model, seen


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_peer_tests_model_records_each_batch_once_as_with_stock_trainer(tmp_path, caplog):
    _, stock, _ = run(tmp_path, layerwise=False)
    with caplog.at_level("INFO", logger="layerwise_hf.optim.norm_pass"):
        _, layerwise, _ = run(tmp_path, layerwise=True)
    assert "measuring by 'rerun'" in caplog.text  # the second forward did run
    assert layerwise.data_order.tolist() == stock.data_order.tolist()
    assert len(stock.data_order) == 12 and len(set(stock.data_order.tolist())) == 12
    assert layerwise.calls == stock.calls == 6
    assert torch.equal(layerwise.load, stock.load)
    assert "data_order" in dict(layerwise.named_buffers())
    assert_params_equal(layerwise, stock)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_forward_hook_sees_each_micro_batch_once_as_with_stock_trainer(tmp_path, caplog):
    _, stock, stock_seen = run(tmp_path, layerwise=False, hook=True)
    with caplog.at_level("INFO", logger="layerwise_hf.optim.norm_pass"):
        trainer, layerwise, seen = run(tmp_path, layerwise=True, hook=True)
    # The hook's list cannot be put back: `auto` holds the gradients instead of running forward twice.
    assert "measuring by 'hold'" in caplog.text and "forward hooks (on linear Linear" in caplog.text
    assert seen == stock_seen and len(seen) == 6
    assert layerwise.data_order.tolist() == stock.data_order.tolist()
    assert_params_equal(layerwise, stock)


def test_forward_state_puts_back_replaced_and_in_place_changes():
    model = RecordingModel()
    original = model.data_order
    state = ForwardState(model)
    x = torch.ones(2, WIDTH)
    model(x, x, torch.tensor([4, 5]))
    model.register_buffer("new", torch.ones(1))  # registered during a forward
    model.extra = 1
    state.restore()
    assert model.data_order is original and model.data_order.numel() == 0
    assert model.calls == 0 and not model.load.any()
    assert "new" not in dict(model.named_buffers()) and not hasattr(model, "extra")


def test_forward_state_puts_back_batchnorm_statistics_in_place():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    mean = model[1].running_mean
    state = ForwardState(model)
    model(torch.randn(4, 3))
    state.restore()
    assert model[1].running_mean is mean and not mean.any() and int(model[1].num_batches_tracked) == 0


def test_rerun_repeats_names_user_hooks_and_not_transformers_own():
    from helpers import tiny_llama

    model = tiny_llama()
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()  # what Trainer does for PEFT with checkpointing: a transformers hook
    ids = torch.randint(0, 32, (1, 8))
    model(input_ids=ids, output_hidden_states=True)  # transformers' output-capturing hooks
    assert rerun_repeats(model) == ""
    model.model.layers[0].register_forward_pre_hook(lambda module, args: None)
    assert rerun_repeats(model).startswith("forward hooks (on model.layers.0 LlamaDecoderLayer: ")
    assert NormPass("hold") is NormPass.HOLD


class OrderLog(torch.nn.Module):
    """The shape of transformers' `test_resume_batch_order` model: a bias-free 10 x 10 layer whose forward appends the
    batch's row ids (column 0 of the inputs) to a buffer by replacing it; a resized buffer loads from a checkpoint."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(10, 10, bias=False)
        self.register_buffer("data_order", torch.empty(0, dtype=torch.long))

    def load_state_dict(self, state_dict, strict=True):
        if "data_order" in state_dict and self.data_order.shape != state_dict["data_order"].shape:
            self.data_order = state_dict["data_order"].clone()
        return super().load_state_dict(state_dict, strict=strict)

    def forward(self, input_ids, labels=None):
        logits = self.fc(input_ids)
        self.data_order = torch.cat([self.data_order, input_ids[:, 0].int().detach().clone()])
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


class Rows(torch.utils.data.Dataset):
    def __init__(self, size: int = 10):
        g = torch.Generator().manual_seed(42)
        self.data = torch.randn((size, 10), generator=g)
        self.data[:, 0] = torch.arange(size)
        self.labels = torch.randint(0, 10, (size,), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.labels[i]}


def _order_run(out, layerwise: bool, resume=None):
    from safetensors.torch import load_file
    from transformers import set_seed

    set_seed(42)
    model = OrderLog()
    cls, args_cls = (LayerwiseTrainer, LayerwiseTrainingArguments) if layerwise else (Trainer, TrainingArguments)
    args = args_cls(output_dir=str(out), seed=42, learning_rate=0.1, per_device_train_batch_size=2, save_steps=1,
                    num_train_epochs=3, optim="sgd_layerwise" if layerwise else "sgd", disable_tqdm=True,
                    dataloader_num_workers=0, report_to="none", use_cpu=True)  # fmt: skip
    cls(model=model, args=args, train_dataset=Rows()).train(resume_from_checkpoint=resume)
    return load_file(out / "checkpoint-15" / "model.safetensors")["data_order"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_peer_resume_batch_order_test_passes_layerwise_as_with_stock(tmp_path):
    # transformers' test_resume_batch_order, run with LayerwiseTrainer and sgd_layerwise at the defaults.
    stock = _order_run(tmp_path / "stock", layerwise=False)
    baseline = _order_run(tmp_path / "layerwise", layerwise=True)
    resumed = _order_run(tmp_path / "resumed", layerwise=True, resume=str(tmp_path / "layerwise" / "checkpoint-6"))
    assert len(stock) == 30
    assert torch.equal(baseline, stock) and torch.equal(resumed, stock)


def test_forward_state_keeps_buffers_registered_as_none_and_clones_no_graph_tensor():
    model = RecordingModel()
    model.register_buffer("absent", None)
    model.last_output = torch.ones(3, requires_grad=True) * 2  # an activation kept on the module
    kept = model.last_output
    state = ForwardState(model)
    assert (model, "last_output") not in state.values  # put back by identity, never cloned
    model.last_output = torch.zeros(3)
    state.restore()
    assert "absent" in model._buffers and model._buffers["absent"] is None
    assert model.last_output is kept
