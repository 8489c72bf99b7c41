"""Optimizers that cannot step a DTensor, stepped on FSDP2's local shards (bitsandbytes' 8-bit AdamW, Adafactor): the
8-bit blocks and Adafactor's factored moments follow the shard. Bit-identical to the same optimizer run by hand on
those shards, resumable on the same number of shards (refused on another), and on the loss curve of the unsharded
run within the noise 8-bit quantization itself adds."""

import statistics

import pytest
from test_distributed import launch

pytest.importorskip("bitsandbytes")


def gap(a, b):
    return statistics.mean(abs(x - y) for x, y in zip(a, b))


@pytest.mark.slow
def test_local_shard_optimizers_match_by_hand_resume_and_follow_the_unsharded_curve(tmp_path):
    report = launch(
        "configs/accelerate/cpu_fsdp2.yaml",
        "tests/distributed/fsdp2_8bit.py",
        tmp_path / "fsdp2.json",
        {"LAYERWISE_HF_FORCE_FSDP_CPU": "1"},
    )
    assert report["world_size"] == 2
    eight_bit, adafactor = report["adamw_8bit_layerwise"], report["adafactor_layerwise"]
    for result in (eight_bit, adafactor):
        assert result["wrapped"] and result["hand_max_diff"] == 0.0, result
        assert result["resume_max_diff"] == 0.0 and result["resume_grad_norm_equal"], result
    assert 0 < eight_bit["eight_bit_states"] < eight_bit["states"]  # 8-bit shards, and small ones kept in 32-bit
    assert 0 < adafactor["factored_states"] < adafactor["states"]  # matrices factored, vectors not

    # On 3 ranks the shards no longer match: refused before any step, saying what works.
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

    curves = launch("configs/accelerate/cpu_ddp.yaml", "tests/distributed/fsdp2_8bit.py", tmp_path / "ddp.json")[
        "curves"
    ]
    sharded, unsharded, full = eight_bit["curve"], curves["adamw_8bit_layerwise"], curves["adamw_torch_layerwise"]
    assert len(sharded) == len(unsharded) == 50
    # Blocks of the shard instead of the whole tensor move the curve by about what 8-bit states move it by.
    assert gap(sharded, unsharded) <= 2 * gap(unsharded, full)
    last = statistics.mean(unsharded[-10:])
    assert abs(statistics.mean(sharded[-10:]) - last) <= 0.02 * last
    assert statistics.mean(sharded[-10:]) < sharded[0] - 1.0  # it trains
    # Adafactor on shards: another factorization of the second moment, the same course of training.
    sharded, unsharded = adafactor["curve"], curves["adafactor_layerwise"]
    last = statistics.mean(unsharded[-10:])
    assert abs(statistics.mean(sharded[-10:]) - last) <= 0.03 * last
    assert statistics.mean(sharded[-10:]) < sharded[0] - 0.5
