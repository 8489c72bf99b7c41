"""bitsandbytes' 8-bit AdamW layer-wise under FSDP2: each rank steps its local shard (the quantization blocks follow
the shard), bit-identical to the same optimizer run by hand on those shards, resumable, and on the loss curve of the
unsharded run within the noise 8-bit quantization itself adds."""

import statistics

import pytest
from test_distributed import launch

pytest.importorskip("bitsandbytes")


@pytest.mark.slow
def test_8bit_states_step_local_shards_like_by_hand_and_resume(tmp_path):
    report = launch(
        "configs/accelerate/cpu_fsdp2.yaml",
        "tests/distributed/fsdp2_8bit.py",
        tmp_path / "fsdp2.json",
        {"LAYERWISE_HF_FORCE_FSDP_CPU": "1"},
    )
    assert report["world_size"] == 2 and report["wrapped"]
    assert 0 < report["eight_bit_states"] < report["states"]  # 8-bit shards, and small ones with a 32-bit state
    assert report["hand_max_diff"] == 0.0
    assert report["resume_max_diff"] == 0.0 and report["resume_grad_norm_equal"]

    # On 3 ranks the blocks no longer match: refused before any step, saying what works.
    reshard = launch(
        "configs/accelerate/cpu_fsdp2.yaml",
        "tests/distributed/fsdp2_8bit.py",
        tmp_path / "reshard.json",
        {"LAYERWISE_HF_FORCE_FSDP_CPU": "1"},
        launch_args=["--num_processes", "3"],
        script_args=["reshard"],
    )
    assert reshard["steps"] == [], reshard
    assert "saved on 2 FSDP2 shards; this run has 3" in reshard["refusal"] and "Resume with 2" in reshard["refusal"]

    unsharded = launch("configs/accelerate/cpu_ddp.yaml", "tests/distributed/fsdp2_8bit.py", tmp_path / "ddp.json")
    sharded, eight_bit, full = (
        report["curve"],
        *(unsharded["curves"][k] for k in ("adamw_8bit_layerwise", "adamw_torch_layerwise")),
    )
    assert len(sharded) == len(eight_bit) == 50

    def gap(a, b):
        return statistics.mean(abs(x - y) for x, y in zip(a, b))

    # Blocks of the shard instead of the whole tensor move the curve by about what 8-bit states move it by.
    assert gap(sharded, eight_bit) <= 2 * gap(eight_bit, full)
    assert abs(statistics.mean(sharded[-10:]) - statistics.mean(eight_bit[-10:])) <= 0.02 * statistics.mean(
        eight_bit[-10:]
    )
    assert statistics.mean(sharded[-10:]) < sharded[0] - 1.0  # it trains
