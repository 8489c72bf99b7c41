"""Checkpoints past one folder: FSDP's FULL_STATE_DICT optimizer file counts as optimizer state, and a checkpoint whose
DCP folders are not whole where it was written (an output folder per node, `save_on_each_node=True` without a shared
file system) is neither marked complete nor resumed from."""

import json
import logging
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from layerwise_hf.integrations.checkpoint import (
    check_checkpoint,
    is_complete,
    latest_complete_checkpoint,
    mark_complete,
    unloadable_dcp_parts,
    warn_missing_optimizer_state,
)

LOGGER = "layerwise_hf.integrations.checkpoint"
# dcp.save in one process, as these tests mean to.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def fsdp_full_state_checkpoint(path):
    # The files accelerate's save_fsdp_model / save_fsdp_optimizer write under FULL_STATE_DICT, plus Trainer's own.
    from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME

    os.makedirs(path)
    torch.save({"w": torch.ones(2)}, os.path.join(path, f"{FSDP_MODEL_NAME}.bin"))
    torch.save({"state": {}, "param_groups": []}, os.path.join(path, f"{OPTIMIZER_NAME}.bin"))
    torch.save({"last_epoch": 1}, os.path.join(path, "scheduler.pt"))
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 2}, f)
    return path


def dcp_checkpoint(path):
    # A sharded (DCP) checkpoint as one process writes it: each folder has its .distcp files and .metadata.
    os.makedirs(path)
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=os.path.join(path, folder))
    torch.save({"last_epoch": 1}, os.path.join(path, "scheduler.pt"))
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 2}, f)
    return path


def test_fsdp_full_state_dict_optimizer_is_not_reported_missing(tmp_path, caplog):
    checkpoint = fsdp_full_state_checkpoint(str(tmp_path / "checkpoint-2"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        warn_missing_optimizer_state(checkpoint)
    assert "fresh" not in caplog.text
    os.remove(os.path.join(checkpoint, "optimizer.bin"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        warn_missing_optimizer_state(checkpoint)
    assert "has no optimizer.pt: training resumes with a fresh optimizer" in caplog.text


def test_whole_dcp_checkpoint_is_marked_and_resumable(tmp_path):
    checkpoint = dcp_checkpoint(str(tmp_path / "checkpoint-2"))
    assert unloadable_dcp_parts(checkpoint) == []
    check_checkpoint(checkpoint)
    mark_complete(checkpoint, {"global_step": 2})
    assert is_complete(checkpoint)


@pytest.mark.parametrize("node", ["first node (no other rank's .distcp)", "second node (no .metadata)"])
def test_dcp_checkpoint_split_over_node_folders_is_not_marked_and_refused_at_resume(tmp_path, caplog, node):
    run_dir = tmp_path / "run"
    older = dcp_checkpoint(str(run_dir / "checkpoint-1"))
    mark_complete(older)
    checkpoint = dcp_checkpoint(str(run_dir / "checkpoint-2"))
    folder = os.path.join(checkpoint, "optimizer_0")
    if node.startswith("first"):
        # What global rank 0's node keeps: .metadata lists every rank's file, the other node's are elsewhere.
        for name in os.listdir(folder):
            if name.endswith(".distcp"):
                os.remove(os.path.join(folder, name))
    else:
        os.remove(os.path.join(folder, ".metadata"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        mark_complete(checkpoint, {"global_step": 2})
    assert not is_complete(checkpoint)
    assert "Not marking" in caplog.text and "save_on_each_node=True" in caplog.text
    # resume_from_checkpoint=True takes the older, loadable checkpoint.
    assert latest_complete_checkpoint(str(run_dir)) == older
    with pytest.raises(ValueError, match=r"optimizer_0/.*shared file system"):
        check_checkpoint(checkpoint)
