import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread per test worker, and for what the tests launch unless they say otherwise: xdist runs a worker per
# core, and two threads of tiny ops per worker wait on each other (test_clipping's fast tests at load 5: 23.0 s on
# torch's 2 default threads, 2.1 s on one). The launched 2-rank scripts already run on one thread each, so an
# in-process reference and a launched run now share the thread count.
os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message=".*max_grad_norm.*")

import torch  # noqa: E402
from helpers import freeze_imported_objects  # noqa: E402  (imports Trainer and layerwise_hf)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # torch may have been imported before (a plugin)
freeze_imported_objects()


@pytest.fixture(autouse=True)
def _same_environment_for_every_test():
    # NOTE: transformers < 5 writes TrainingArguments' settings into os.environ (ACCELERATE_MIXED_PRECISION,
    # ACCELERATE_USE_FSDP, FSDP_*), where every later Accelerator of the process reads them: a bf16 or FSDP test would
    # change the tests after it.
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# The fast tier (`pytest -m "not slow"`) is the loop every change goes through, and what CI runs on the oldest and
# newest tested combinations: it keeps one case of each behaviour, and the full suite runs the rest. Listed here
# rather than on each parametrize list so that the split is read in one place. Per test function: `None` puts every
# case in the full suite only; a set names the cases that stay in the fast tier.
FULL_SUITE_ONLY = {
    # Launched processes (2 gloo ranks, a subprocess of the CLI or of a script): 15-45 s each on 2 cores.
    "tests/test_distributed.py::test_data_parallel_gradient_memory_is_bounded_by_what_is_in_flight": None,
    "tests/test_cli.py::test_cli_lora_fsdp2_and_presets": None,
    "tests/test_plan_ranks.py::test_matches_a_real_two_rank_run": None,
    "tests/test_plan_ranks.py::test_cpu_plan_matches_the_peak_of_a_real_gloo_fsdp2_run": None,
    "tests/test_launcher.py::test_trl_sft_script_through_launcher_matches_layerwise_sft_trainer": None,
    "tests/test_launcher.py::test_nothing_is_patched_at_import": None,
    "tests/test_preflight.py::test_off_by_default_does_not_import_the_planner": None,
    "tests/test_plan_offload.py::test_a_direct_call_inside_a_launched_run_plans_as_one_process": None,
    "tests/test_examples.py::test_readme_quotes_the_main_jobs_gradient_peak": None,
    "tests/test_docs.py::test_readme_tables_are_generated_from_the_registry": None,
    "tests/test_benchmarks.py::test_plan_accuracy_quick": None,
    "tests/test_checkpoint.py::test_convert_checkpoint_offline": None,
    # Planner runs over every layer (the extrapolation checked against the full simulation).
    "tests/test_plan.py::test_extrapolated_layers_equal_the_full_simulation": None,
    "tests/test_plan_offload.py::test_extrapolated_layers_equal_the_full_simulation_with_offload": None,
    "tests/test_plan_offload.py::test_device_memory_judges_the_device_peak_and_host_memory_the_host_peak": None,
    # Parametrized repeats of one behaviour: one case stays in the fast tier.
    "tests/test_checkpoint.py::test_resume_equals_uninterrupted": {"1-adamw_torch_layerwise"},
    "tests/test_checkpoint.py::test_switching_between_standard_and_layerwise_on_resume": {"to_layerwise-adamw_torch"},
    "tests/test_checkpoint.py::test_resume_with_previous_norm_clipping_is_exact": None,
    "tests/test_clipping.py::test_exact_clipping_matches_trainer": {"sgd-1-auto"},
    "tests/test_clipping.py::test_exact_clipping_with_gradient_checkpointing_matches_trainer": {"reentrant"},
    "tests/test_clipping.py::test_pure_bf16_weights_match_standard": {"adamw_torch"},
    "tests/test_clipping.py::test_one_pass_modes_bound_every_applied_gradient": {"per_param"},
    "tests/test_lifecycle.py::test_auto_find_batch_size_after_oom_in_backward_retries_from_weights_like_stock": {
        "per_param"
    },
    "tests/test_lifecycle.py::test_tensor_frozen_between_train_calls_trains_on_like_stock": {"adamw_torch"},
    "tests/test_galore.py::test_matches_standard_galore_with_weight_decay_split": {"galore_adamw_layerwise-1"},
    "tests/test_galore.py::test_layerwise_forms_match_stock_trainer": {"galore_adamw_layerwise-1"},
    "tests/test_galore.py::test_resume_equals_uninterrupted": {"galore_adamw_layerwise"},
    "tests/test_fp16.py::test_fp16_matches_standard_gradscaler": {"1-exact_clip"},
    "tests/test_fp16.py::test_fp16_overflow_changes_nothing_and_halves_the_scale": {"1-exact_clip"},
}


def pytest_collection_modifyitems(config, items):
    known = set()
    for item in items:
        function, _, case = item.nodeid.partition("[")
        if function not in FULL_SUITE_ONLY:
            continue
        known.add(function)
        keep = FULL_SUITE_ONLY[function]
        if keep is None or case.rstrip("]") not in keep:
            item.add_marker(pytest.mark.slow)
    # A renamed test must not silently move back into the fast tier: checked when whole files were collected.
    if config.getoption("keyword") or any("::" in str(arg) for arg in config.args):
        return
    collected_files = {item.nodeid.split("::")[0] for item in items}
    stale = [f for f in FULL_SUITE_ONLY if f.split("::")[0] in collected_files and f not in known]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py FULL_SUITE_ONLY names tests that do not exist: {stale}")


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A one-rank gloo process group for the module's tests (DDP and the data-parallel route in one process). One group
    per module: collecting the DDP models each test leaves (gc, about 0.5 s) is done once, at the end."""
    import gc

    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("group") / "store"), 1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        yield
    finally:
        gc.collect()  # no DDP reducer may outlive the group
        dist.barrier()  # NOTE: gloo was seen to abort at exit without a barrier before destroy_process_group
        dist.destroy_process_group()
