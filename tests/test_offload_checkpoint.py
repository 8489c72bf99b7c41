"""Checkpoints across host offload on and off (issue 19, item 7): a checkpoint written with `layerwise_offload` has the
format of one written without it, so resume, crash resume and `layerwise-hf convert-checkpoint` work across offload
on and off, and the result is the uninterrupted run of the standard optimizer (stock Trainer + `adamw_torch`): every
parameter, every optimizer state and every group's learning rate, bit for bit.

Every offloaded run takes the path a GPU takes (host buffers, the host worker, a copy thread for the side stream with
a delay on every copy). The crash tests run this file as a script (`python tests/test_offload_checkpoint.py OUT ...`)
and SIGKILL it: at a step's end while the host worker still steps, inside the host worker in the middle of a step, and
while a checkpoint is being written.
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TokenDataset, tiny_llama, train, training_args
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback

from layerwise_hf.optim.state import is_layerwise_state_dict, standard_groups_names
from layerwise_hf.placement import transfer as transfer_module

SIMULATED = {transfer_module.SIMULATE_ENV: "1", transfer_module.DELAY_ENV: "0.001"}
# Two ways a step goes with offload. "window": gradient accumulation and exact clipping, so every gradient waits in a
# host buffer for the window's global norm and is stepped from there. "backward": GA 1 and no clipping, so with
# layerwise_offload="optimizer" each parameter is stepped by the host worker while backward goes on.
CONFIGS = {
    "window": dict(gradient_accumulation_steps=2, max_grad_norm=1.0, per_device_train_batch_size=2),
    "backward": dict(gradient_accumulation_steps=1, max_grad_norm=0.0, per_device_train_batch_size=4),
}
RUN = dict(max_steps=6, save_strategy="steps", save_steps=3)


@pytest.fixture(autouse=True)
def simulated_offload(monkeypatch):
    for key, value in SIMULATED.items():
        monkeypatch.setenv(key, value)


def _run(out, offload: str | None, config: str, resume=None, trainer_cls=None, save_steps=3, **trainer_kwargs):
    """Train the tiny Llama for 6 steps; `offload=None` is the reference: stock Trainer with adamw_torch."""
    optim = "adamw_torch" if offload is None else "adamw_torch_layerwise"
    kwargs = {**RUN, **CONFIGS[config], "save_steps": save_steps}
    if offload is not None:
        kwargs["layerwise_offload"] = offload
    args = training_args(out, optim, **kwargs)
    cls = trainer_cls or (Trainer if offload is None else None)
    return train(
        tiny_llama(), args, TokenDataset(n=32), trainer_cls=cls, resume_from_checkpoint=resume, **trainer_kwargs
    )


def _groups_names() -> list[list[str]]:
    """Trainer's (weight-decay, no-decay) parameter names of the tiny Llama: the standard layout's two groups."""
    model = tiny_llama()
    decay = set(Trainer.get_decay_parameter_names(None, model))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return standard_groups_names(names, [n in decay for n in names])


def optimizer_states(checkpoint: Path) -> dict[str, dict]:
    """Per parameter name: its optimizer state and its group's lr, from either layout of `optimizer.pt`."""
    state_dict = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    out = {}
    if is_layerwise_state_dict(state_dict):
        for group in state_dict["param_groups"]:
            (i,) = group["params"]
            out[group["name"]] = {**state_dict["state"].get(i, {}), "lr": group["lr"]}
        return out
    for group, names in zip(state_dict["param_groups"], _groups_names(), strict=True):
        assert len(group["params"]) == len(names)
        for i, name in zip(group["params"], names):
            out[name] = {**state_dict["state"].get(i, {}), "lr": group["lr"]}
    return out


def assert_states_equal(expected: dict[str, dict], actual: dict[str, dict]) -> None:
    assert expected.keys() == actual.keys()
    for name, state in expected.items():
        assert state.keys() == actual[name].keys(), name
        assert {"exp_avg", "exp_avg_sq", "step"} <= state.keys(), name  # AdamW's state, not a fresh one
        for key, value in state.items():
            other = actual[name][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), f"{name}.{key} differs: max {(value - other).abs().max()}"
            else:
                assert value == other, f"{name}.{key}: {value} != {other}"


def assert_weights_equal(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        assert torch.equal(value, actual[name]), f"{name} differs: max {(value - actual[name]).abs().max()}"


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per config and save_steps: the uninterrupted stock Trainer + adamw_torch run (final weights, run directory)."""
    runs = {}

    def get(config: str, save_steps: int = 3):
        if (config, save_steps) not in runs:
            out = tmp_path_factory.mktemp(f"reference-{config}-{save_steps}")
            trainer = _run(out, None, config, save_steps=save_steps)
            runs[config, save_steps] = (_weights(trainer.model), out)
        return runs[config, save_steps]

    return get


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    """Per (offload mode, config): an uninterrupted layer-wise run with offload, saving checkpoints 3 and 6."""
    runs = {}

    def get(offload: str, config: str):
        if (offload, config) not in runs:
            out = tmp_path_factory.mktemp(f"offload-{offload}-{config}")
            with pytest.MonkeyPatch.context() as mp:
                for key, value in SIMULATED.items():
                    mp.setenv(key, value)
                trainer = _run(out, offload, config)
            runs[offload, config] = (_weights(trainer.model), out)
        return runs[offload, config]

    return get


def _check_resumed(reference, config: str, trainer, out: Path) -> None:
    expected_weights, reference_dir = reference(config)
    assert trainer.state.global_step == RUN["max_steps"]
    assert_weights_equal(expected_weights, _weights(trainer.model))
    assert_states_equal(optimizer_states(reference_dir / "checkpoint-6"), optimizer_states(out / "checkpoint-6"))


# (saved with, resumed with): a checkpoint written with offload resumed with offload on and off, and one written
# without offload (stock Trainer's, and the layer-wise optimizer's) resumed with each offload mode.
ACROSS = [
    ("optimizer", "optimizer", "backward"),
    ("optimizer", "optimizer", "window"),
    ("optimizer", "none", "backward"),
    ("optimizer", "none", "window"),
    ("optimizer", "gradients", "window"),
    ("gradients", "gradients", "window"),
    ("gradients", "none", "window"),
    ("gradients", "optimizer", "window"),
    ("standard", "optimizer", "backward"),
    ("standard", "optimizer", "window"),
    ("standard", "gradients", "window"),
    ("none", "optimizer", "window"),
    ("none", "gradients", "window"),
]
# The fast tier: each offload mode saved and resumed on and off, and a stock Trainer checkpoint resumed with offload.
FAST = {
    ("optimizer", "optimizer", "backward"),
    ("optimizer", "none", "window"),
    ("gradients", "optimizer", "window"),
    ("standard", "gradients", "window"),
}
ACROSS = [pytest.param(*case, marks=() if case in FAST else pytest.mark.slow) for case in ACROSS]


@pytest.mark.parametrize("saved_with, resumed_with, config", ACROSS)
def test_resume_across_offload_equals_uninterrupted_standard_run(
    tmp_path, reference, offloaded, saved_with, resumed_with, config
):
    if saved_with == "standard":
        source = reference(config)[1]
    else:
        weights, source = offloaded(saved_with, config)
        # The uninterrupted offloaded run is the standard one too, checkpoint included.
        assert_weights_equal(reference(config)[0], weights)
        assert_states_equal(
            optimizer_states(reference(config)[1] / "checkpoint-3"), optimizer_states(source / "checkpoint-3")
        )
    checkpoint = source / "checkpoint-3"
    trainer = _run(tmp_path, resumed_with, config, resume=str(checkpoint))
    _check_resumed(reference, config, trainer, tmp_path)


# ---- layerwise-hf convert-checkpoint ----


def convert(capsys, checkpoint: Path, to: str, output_dir: Path) -> Path:
    """`layerwise-hf convert-checkpoint CHECKPOINT --to TO --output_dir OUTPUT_DIR`, as a user runs it."""
    from layerwise_hf.cli import main

    capsys.readouterr()
    assert main(["convert-checkpoint", str(checkpoint), "--to", to, "--output_dir", str(output_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(output_dir)
    return output_dir


@pytest.mark.parametrize(
    "saved_with, config", [("optimizer", "backward"), pytest.param("gradients", "window", marks=pytest.mark.slow)]
)
def test_convert_checkpoint_written_with_offload_to_standard_and_back(
    tmp_path, capsys, reference, offloaded, saved_with, config
):
    _, reference_dir = reference(config)
    source = offloaded(saved_with, config)[1] / "checkpoint-3"
    before = {name: (source / name).read_bytes() for name in ("optimizer.pt", "scheduler.pt")}

    standard = convert(capsys, source, "standard", tmp_path / "standard")
    # The converted files are what stock Trainer itself wrote at that step: groups, states, schedule.
    expected = torch.load(reference_dir / "checkpoint-3" / "optimizer.pt", weights_only=True)
    converted = torch.load(standard / "optimizer.pt", weights_only=True)
    assert converted["param_groups"] == expected["param_groups"]
    assert_states_equal(optimizer_states(reference_dir / "checkpoint-3"), optimizer_states(standard))
    assert torch.load(standard / "scheduler.pt", weights_only=True) == torch.load(
        reference_dir / "checkpoint-3" / "scheduler.pt", weights_only=True
    )
    # Stock Trainer (no plugin code at load time) resumes from it and ends as the uninterrupted run.
    resumed = _run(tmp_path / "stock", None, config, resume=str(standard))
    _check_resumed(reference, config, resumed, tmp_path / "stock")

    back = convert(capsys, standard, "layerwise", tmp_path / "back")
    assert_states_equal(optimizer_states(source), optimizer_states(back))
    # Back to layer-wise, resumed with the offload it was written with.
    resumed = _run(tmp_path / "offloaded", saved_with, config, resume=str(back))
    _check_resumed(reference, config, resumed, tmp_path / "offloaded")
    assert {name: (source / name).read_bytes() for name in before} == before, "the source must not change"


def test_standard_checkpoint_converted_to_layerwise_resumes_with_offload(tmp_path, capsys, reference):
    _, reference_dir = reference("backward")
    layerwise = convert(capsys, reference_dir / "checkpoint-3", "layerwise", tmp_path / "layerwise")
    resumed = _run(tmp_path / "resumed", "optimizer", "backward", resume=str(layerwise))
    _check_resumed(reference, "backward", resumed, tmp_path / "resumed")


# ---- crash resume: this file run as a script, SIGKILLed ----

CRASH_SAVE_STEPS = 2  # checkpoints 2, 4 and 6


def crash_run(out: Path, *options: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **SIMULATED, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    cmd = [sys.executable, __file__, str(out), *options]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def checkpoint_equal(expected: Path, actual: Path) -> None:
    """A checkpoint's weights (every tensor of model.safetensors) and optimizer states equal the reference's."""
    a, b = load_file(expected / "model.safetensors"), load_file(actual / "model.safetensors")
    assert_weights_equal(a, b)
    assert_states_equal(optimizer_states(expected), optimizer_states(actual))


CRASHES = [
    # The host worker still steps step 5's parameters when the process dies at the step's end; checkpoint 4 was
    # written while step 4's host steps were held back, so its save had to wait for them.
    ("optimizer", "backward", "step:5", "4"),
    # Killed inside the host worker, half of step 5's parameters stepped on the host.
    ("optimizer", "backward", "host:5", None),
    # Killed between the micro-batches of step 5: the first one's gradients are in host buffers.
    ("optimizer", "window", "micro:5", None),
    ("gradients", "window", "micro:5", None),
    # Killed while writing checkpoint 4 (the model and half of optimizer.pt written).
    ("optimizer", "backward", "save:4", "4"),
    ("gradients", "window", "save:4", None),
]


@pytest.mark.slow
@pytest.mark.parametrize("offload, config, kill, hold", CRASHES)
def test_sigkill_with_offload_then_resume_equals_uninterrupted(tmp_path, reference, offload, config, kill, hold):
    options = ["--offload", offload, "--config", config]
    crashed = crash_run(tmp_path, *options, "--kill", kill, *(["--hold", hold] if hold else []))
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout[-2000:] + crashed.stderr[-3000:]
    where, step = kill.split(":")
    in_flight = [line for line in crashed.stdout.splitlines() if line.startswith("in flight at the kill:")]
    if where in ("step", "host", "micro"):
        # What the test is about really was in flight when the process died.
        assert in_flight and int(in_flight[-1].split(":")[1]) > 0, crashed.stdout[-2000:]
    last = 4 if where != "save" else 2
    if where == "save":
        assert not (tmp_path / "checkpoint-4" / "layerwise_complete.json").exists()
    _, reference_dir = reference(config, CRASH_SAVE_STEPS)
    # Nothing already saved is lost: every complete checkpoint is the uninterrupted standard run's.
    for saved in range(CRASH_SAVE_STEPS, last + 1, CRASH_SAVE_STEPS):
        assert (tmp_path / f"checkpoint-{saved}" / "layerwise_complete.json").exists()
        checkpoint_equal(reference_dir / f"checkpoint-{saved}", tmp_path / f"checkpoint-{saved}")
    resumed = crash_run(tmp_path, *options, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {tmp_path / f'checkpoint-{last}'}" in resumed.stdout
    checkpoint_equal(reference_dir / "checkpoint-6", tmp_path / "checkpoint-6")


def launch(engine: str, out: Path, *options: str) -> subprocess.CompletedProcess:
    """This file as a script on 2 gloo ranks, under the DDP config or FSDP2."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, **SIMULATED, "PYTHONPATH": str(root), "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    if engine == "fsdp2":
        env["LAYERWISE_HF_FORCE_FSDP_CPU"] = "1"
    config = root / "configs" / "accelerate" / f"cpu_{engine}.yaml"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    cmd += ["--main_process_port", str(port), __file__, str(out), *options]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def two_rank_reference(tmp_path_factory):
    """Per engine: the final weights of the uninterrupted stock Trainer + adamw_torch run on 2 ranks."""
    runs = {}

    def get(engine: str):
        if engine not in runs:
            out = tmp_path_factory.mktemp(f"two-ranks-{engine}")
            full = launch(engine, out, "--offload", "standard", "--config", "window")
            assert full.returncode == 0, full.stderr[-3000:]
            runs[engine] = load_file(out / "final" / "model.safetensors")
        return runs[engine]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine, saved_with, resumed_with",
    [
        ("fsdp2", "gradients", "gradients"),
        # Each rank's shard of the host states is saved (DCP kept one rank's shard under each key before).
        ("fsdp2", "optimizer", "none"),
        ("ddp", "optimizer", "none"),
        # Trainer loads an FSDP2 optimizer through torch's get_optimizer_state_dict, which steps it once before
        # loading (see test_a_zero_step_before_loading_keeps_the_loaded_weights).
        ("fsdp2", "optimizer", "optimizer"),
        ("fsdp2", "none", "optimizer"),
    ],
)
def test_two_ranks_sigkill_during_checkpoint_write_then_resume_with_offload(
    tmp_path, two_rank_reference, engine, saved_with, resumed_with
):
    expected = two_rank_reference(engine)
    crashed = launch(engine, tmp_path, "--offload", saved_with, "--config", "window", "--kill", "save:4")
    assert crashed.returncode != 0
    assert (tmp_path / "checkpoint-2" / "layerwise_complete.json").exists()
    assert not (tmp_path / "checkpoint-4" / "layerwise_complete.json").exists()
    resumed = launch(engine, tmp_path, "--offload", resumed_with, "--config", "window", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {tmp_path / 'checkpoint-2'}" in resumed.stdout
    assert_weights_equal(expected, load_file(tmp_path / "final" / "model.safetensors"))


def test_a_zero_step_before_loading_keeps_the_loaded_weights(tmp_path):
    # What FSDP2's resume does, on one process: the optimizer exists, the checkpoint's weights are loaded into the
    # model, then torch's _init_optim_state (get_optimizer_state_dict, before it loads a state) steps the optimizer
    # without state once, zero gradients and lr 0. A host-stepped parameter must write back the loaded weights, not
    # a host copy taken when the optimizer was built (under FSDP2 that copy is not even of the local shard's shape).
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from layerwise_hf.optim.optimizer import build_layerwise_optimizer
    from layerwise_hf.placement.offloading import wait_for_host_steps

    model = tiny_llama()
    optimizer = build_layerwise_optimizer(model, training_args(tmp_path, "adamw_torch_layerwise"), offload="optimizer")
    loaded = tiny_llama(seed=1).state_dict()
    model.load_state_dict(loaded)
    _init_optim_state(optimizer)
    wait_for_host_steps(optimizer)
    assert_weights_equal({n: loaded[n] for n, _ in model.named_parameters()}, _weights(model))


def test_reloading_a_checkpoint_mid_run_in_a_plain_loop_equals_standard():
    # A plain loop that goes back to a checkpoint (model and optimizer state) and trains on, with the optimizer still
    # attached: the host copies of the weights are taken again from the loaded model, as torch's AdamW reads them.
    from layerwise_hf import LayerwiseOptimizer, LayerwiseParam
    from layerwise_hf.optim.optimizer import enable_offload
    from layerwise_hf.placement.offloading import host_step_factory, wait_for_host_steps

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    model, reference = mlp(), mlp()
    params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
    factory, runner = host_step_factory(lambda lp, _: torch.optim.AdamW([lp.param], lr=1e-2), "optimizer")
    layerwise = LayerwiseOptimizer(params, factory, sync_gradients=lambda: True)
    enable_offload(layerwise, "optimizer", runner=runner)
    layerwise.attach()
    standard = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    torch.manual_seed(1)
    batches = [torch.randn(5, 8) for _ in range(6)]
    saved = {}
    for net, optimizer in ((reference, standard), (model, layerwise)):
        for k, x in enumerate(batches):
            if k == 4:  # back to the checkpoint of step 2, then steps 3 and 4 again on other batches
                net.load_state_dict(saved[net][0])
                optimizer.load_state_dict(saved[net][1])
            net(x).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if k in (1, 3):
                wait_for_host_steps(layerwise)  # the copies back, before the weights are read or written by hand
            if k == 1:
                saved[net] = copy.deepcopy((net.state_dict(), optimizer.state_dict()))
    wait_for_host_steps(layerwise)
    assert_weights_equal(dict(reference.named_parameters()), _weights(model))
    for name, (p, q) in zip(layerwise.names, zip(reference.parameters(), model.parameters())):
        for key, value in standard.state[p].items():
            assert torch.equal(value, layerwise.state[q][key]), f"{name}.{key}"


def _crash_main(argv: list[str]) -> None:
    """Train as `_run` does with checkpoints every CRASH_SAVE_STEPS, SIGKILL-ing the process at `--kill`."""
    import threading
    import time

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from layerwise_hf import LayerwiseTrainer
    from layerwise_hf.optim.optimizer import offload_of
    from layerwise_hf.placement.offloading import wait_for_host_steps

    opts = _crash_options(argv)
    where, kill_step = opts.kill.split(":") if opts.kill else (None, "0")
    kill_step = int(kill_step)
    current = [0]  # the step being taken
    release = threading.Event()
    host_steps = [0]

    def die(in_flight: int) -> None:
        print(f"in flight at the kill: {in_flight}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def on_host_step(optimizer, args, kwargs):
        # A global optimizer step pre-hook: here, the wrapped AdamW's step that the host worker runs.
        if threading.current_thread() is threading.main_thread() or not isinstance(optimizer, torch.optim.AdamW):
            return
        host_steps[0] += 1
        if current[0] == opts.hold and host_steps[0] == 1:
            time.sleep(1.0)  # every later host step of this step queues behind this one
        if current[0] == kill_step and where == "step":
            release.wait(120)  # still in flight when the step ends and the process dies
        if current[0] == kill_step and where == "host" and host_steps[0] > len(trainer.layerwise_optimizer.inner) // 2:
            die(len(trainer.layerwise_optimizer.inner) - host_steps[0] + 1)

    register_optimizer_step_pre_hook(on_host_step)

    class Kill(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            # The previous step's host steps end first (the forward would wait for them anyway): they are its own.
            wait_for_host_steps(trainer.layerwise_optimizer)
            current[0] = state.global_step + 1
            host_steps[0] = 0

        def on_substep_end(self, args, state, control, **kwargs):
            if where == "micro" and current[0] == kill_step:
                die(len(offload_of(trainer.layerwise_optimizer).pending()))

        def on_step_end(self, args, state, control, **kwargs):
            if where == "step" and state.global_step == kill_step:
                inner = trainer.layerwise_optimizer.inner
                die(sum(1 for o in inner if getattr(o, "last", None) is not None and not o.last.done()))

    class KillDuringSave(LayerwiseTrainer):
        def _save_optimizer_and_scheduler(self, output_dir):
            super()._save_optimizer_and_scheduler(output_dir)
            if where == "save" and self.state.global_step == kill_step:
                path = os.path.join(output_dir, "optimizer.pt")
                if os.path.isfile(path):  # under FSDP2 the optimizer goes to a DCP directory instead
                    with open(path, "r+b") as f:
                        f.truncate(os.path.getsize(path) // 2)
                os.kill(os.getpid(), signal.SIGKILL)

    if opts.resume:
        from layerwise_hf.integrations.checkpoint import latest_complete_checkpoint

        # One rank, one write: two ranks printing at once interleave on the shared stdout.
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"resuming from {latest_complete_checkpoint(opts.output_dir)}", flush=True)
    kwargs = {**RUN, **CONFIGS[opts.config], "save_steps": CRASH_SAVE_STEPS}
    if opts.offload == "standard":  # the reference: stock Trainer + adamw_torch
        args = training_args(opts.output_dir, "adamw_torch", **kwargs)
        trainer = Trainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(n=32))
    else:
        args = training_args(opts.output_dir, "adamw_torch_layerwise", **kwargs, layerwise_offload=opts.offload)
        trainer = KillDuringSave(model=tiny_llama(), args=args, train_dataset=TokenDataset(n=32), callbacks=[Kill()])
    trainer.train(resume_from_checkpoint=True if opts.resume else None)
    _save_final(trainer, opts.output_dir)


def _crash_options(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--offload", required=True, help="none, gradients, optimizer, or standard (stock Trainer)")
    parser.add_argument("--config", required=True)
    parser.add_argument("--kill", default=None, help="step:N, host:N, micro:N or save:N")
    parser.add_argument("--hold", type=int, default=None, help="hold step N's host steps back for a second")
    parser.add_argument("--resume", action="store_true")
    return parser.parse_args(argv)


def _save_final(trainer, output_dir: str) -> None:
    # Full parameters on every engine (FSDP2 shards are gathered; every rank takes part, rank 0 writes).
    final = {n: getattr(p, "full_tensor", p.detach)().detach().clone() for n, p in trainer.model.named_parameters()}
    if trainer.args.process_index == 0:
        from safetensors.torch import save_file

        os.makedirs(os.path.join(output_dir, "final"), exist_ok=True)
        save_file(final, os.path.join(output_dir, "final", "model.safetensors"))


if __name__ == "__main__":
    from helpers import finish_ranks, freeze_imported_objects

    freeze_imported_objects()
    _crash_main(sys.argv[1:])
    finish_ranks()
