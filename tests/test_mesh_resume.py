"""Resume across mesh shapes: checkpoints saved under HSDP 2x2 on 4 gloo ranks, resumed under FSDP2 on 2 ranks;
LayerwiseTrainer equals stock Trainer resumed the same way, bit for bit, both within rounding of the uninterrupted
run. Two launches in all (one saves both checkpoints, one resumes both)."""

import pytest
from test_distributed import launch

ENV = {"LAYERWISE_HF_FORCE_FSDP_CPU": "1", "LAYERWISE_HF_FORCE_MESH_CPU": "1"}


@pytest.mark.slow
def test_hsdp_checkpoint_resumes_on_fsdp2_with_fewer_ranks_as_stock_does(tmp_path):
    def run(ranks, mode, report):
        return launch(
            "configs/accelerate/cpu_ddp.yaml",
            "tests/distributed/mesh_resume.py",
            tmp_path / report,
            ENV,
            launch_args=["--num_processes", str(ranks)],
            script_args=[mode],
        )

    saved = run(4, "save", "saved.json")
    assert saved["world_size"] == 4 and saved["max_diff"] == 0.0, saved
    for name in ("standard", "layerwise"):
        assert saved[name]["meshes"] == [[["dp_replicate", "dp_shard_cp"], [2, 2]]] and saved[name]["plain"] == 0, (
            saved
        )
    assert saved["standard"]["grad_norm"] == saved["layerwise"]["grad_norm"], saved
    report = run(2, "resume", "report.json")
    assert report["world_size"] == 2 and report["ranks_agree"], report
    assert report["max_diff"] == 0.0, report  # layer-wise resumed == stock resumed, bit for bit
    standard, layerwise = report["standard"], report["layerwise"]
    assert standard["grad_norm"] == layerwise["grad_norm"] and len(layerwise["grad_norm"]) == 4, report
    for run_ in (standard, layerwise):
        assert run_["meshes"] == [[[], [2]]] and run_["plain"] == 0, report
        # Every AdamW state was resharded and loaded: 2 saved steps + 2 resumed ones (a fresh state would say 2).
        assert run_["adam_steps"] == [4.0], report
        # The same 4 samples a step, summed in another order: equal to rounding, far below what the two steps moved.
        assert run_["rel_change_steps_3_4"] > 1e-3 and run_["rel_diff_to_uninterrupted"] < 1e-5, report
    assert standard["grad_norm"][:2] == saved["standard"]["grad_norm"][:2]  # from the checkpoint's log history
    assert standard["grad_norm"][2:] == pytest.approx(saved["standard"]["grad_norm"][2:], rel=1e-5)
