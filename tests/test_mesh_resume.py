"""Resume across mesh shapes: checkpoints saved under HSDP 2x2 and under FSDP2 on 4 gloo ranks, resumed under FSDP2
on 2 ranks; LayerwiseTrainer equals stock Trainer resumed the same way, bit for bit, both within rounding of the
uninterrupted run. Two launches in all (one saves all four checkpoints, one resumes them)."""

import pytest
from test_distributed import launch

ENV = {"LAYERWISE_HF_FORCE_FSDP_CPU": "1", "LAYERWISE_HF_FORCE_MESH_CPU": "1"}


# What each layout's ranks hold: (mesh dim names, mesh shape); FSDP2's own 1-D mesh has no names.
SAVED_MESHES = {"hsdp": [[["dp_replicate", "dp_shard_cp"], [2, 2]]], "fsdp2": [[[], [4]]]}


@pytest.mark.slow
def test_hsdp_and_fsdp2_checkpoints_resume_on_fsdp2_with_fewer_ranks_as_stock_does(tmp_path):
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
    assert saved["world_size"] == 4
    for layout, meshes in SAVED_MESHES.items():
        assert saved[layout]["max_diff"] == 0.0, (layout, saved[layout])
        for name in ("standard", "layerwise"):
            assert saved[layout][name]["meshes"] == meshes and saved[layout][name]["plain"] == 0, (layout, saved)
        assert saved[layout]["standard"]["grad_norm"] == saved[layout]["layerwise"]["grad_norm"], saved[layout]
    report = run(2, "resume", "report.json")
    assert report["world_size"] == 2
    for layout in SAVED_MESHES:
        resumed = report[layout]
        assert resumed["ranks_agree"], (layout, resumed)
        assert resumed["max_diff"] == 0.0, (layout, resumed)  # layer-wise resumed == stock resumed, bit for bit
        standard, layerwise = resumed["standard"], resumed["layerwise"]
        assert standard["grad_norm"] == layerwise["grad_norm"] and len(layerwise["grad_norm"]) == 4, (layout, resumed)
        for run_ in (standard, layerwise):
            assert run_["meshes"] == [[[], [2]]] and run_["plain"] == 0, (layout, resumed)
            # Every AdamW state was resharded and loaded: 2 saved steps + 2 resumed ones (a fresh state would say 2).
            assert run_["adam_steps"] == [4.0], (layout, resumed)
            # The same 4 samples a step, summed in another order: equal to rounding, far below what two steps moved.
            assert run_["rel_change_steps_3_4"] > 1e-3 and run_["rel_diff_to_uninterrupted"] < 1e-5, (layout, resumed)
        uninterrupted = saved[layout]["standard"]["grad_norm"]
        assert standard["grad_norm"][:2] == uninterrupted[:2]  # from the checkpoint's log history
        assert standard["grad_norm"][2:] == pytest.approx(uninterrupted[2:], rel=1e-5)
