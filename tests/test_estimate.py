"""`layerwise-hf estimate-memory`: exact parameter counts, optimizer state as the optimizers really allocate it, and
agreement with `accelerate estimate-memory`. Models are built from configs (tiny ones for real, full-size ones on the
meta device); nothing is downloaded."""

import importlib.util
import json
import math

import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from layerwise_hf import LayerwiseTrainingArguments, build_layerwise_optimizer
from layerwise_hf.bases import support
from layerwise_hf.estimate import (
    OPTIMIZER_RULES,
    PRESETS,
    EstimateError,
    ModelSpec,
    TensorSpec,
    accelerate_estimate,
    estimate,
    list_presets,
    load_model_spec,
    resolve_config,
)
from layerwise_hf.estimate.models import PRESETS_DIR, collapse_layers
from layerwise_hf.estimate.optimizers import RULES_FILE, fsdp2_refusal, load_rules
from layerwise_hf.platform.compat import dtype_kwargs

GIB = 2**30

# What `accelerate estimate-memory meta-llama/Llama-2-70b-hf` printed for float16 (its "GB" are GiB).
ACCELERATE_LLAMA2_70B_FP16_TOTAL_GB = 128.15
ACCELERATE_LLAMA2_70B_FP16_ADAM_GB = 512.59

# Published parameter counts (model cards / safetensors metadata).
PUBLISHED_COUNTS = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
}


SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)


def tiny_config(**overrides):
    values = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def within(value, reference, rel=0.01):
    return abs(value - reference) <= rel * reference


# ---- agreement with accelerate ----


def test_llama2_70b_fp16_agrees_with_accelerate_within_1_percent():
    (row,) = accelerate_estimate("llama-2-70b", ["float16"])
    assert within(row.total_bytes / GIB, ACCELERATE_LLAMA2_70B_FP16_TOTAL_GB)
    assert within(row.training_bytes / GIB, ACCELERATE_LLAMA2_70B_FP16_ADAM_GB)
    # This package's own convention (lm_head included, weights + gradients + AdamW state summed) lands there too.
    ours = estimate("llama-2-70b", optimizer="adamw_torch", dtype="fp16")
    assert within(ours.weight_bytes / GIB, ACCELERATE_LLAMA2_70B_FP16_TOTAL_GB)
    assert within(ours.total_bytes / GIB, ACCELERATE_LLAMA2_70B_FP16_ADAM_GB)


@pytest.mark.parametrize("preset", ["llama-2-70b", "llama-3.2-1b", "qwen2.5-0.5b", "qwen3-8b"])
def test_accelerate_mode_prints_what_accelerate_computes(preset):
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes, convert_bytes

    config, _, _ = resolve_config(preset)
    with torch.device("meta"):
        model = AutoModel.from_config(config, **dtype_kwargs(torch.float32))
    total, (largest, _) = calculate_maximum_sizes(model)
    divisors = {"float32": 1, "float16": 2, "int8": 4, "int4": 8}
    for row in accelerate_estimate(preset):
        usage = max(estimate_training_usage(total, row.dtype).values())
        expected = [
            row.dtype,
            convert_bytes(largest / divisors[row.dtype]),
            convert_bytes(total / divisors[row.dtype]),
            convert_bytes(usage) if usage != -1 else "N/A",
        ]
        assert row.format() == expected


def test_accelerate_mode_for_an_architecture_without_formula(tmp_path):
    from accelerate.utils import calculate_maximum_sizes
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300).to_json_file(tmp_path / "config.json")
    config, _, _ = resolve_config(tmp_path)
    with torch.device("meta"):
        total, _ = calculate_maximum_sizes(AutoModel.from_config(config, **dtype_kwargs(torch.float32)))
    (row,) = accelerate_estimate(tmp_path, ["float32"])
    assert row.total_bytes == total and row.training_bytes == 4 * total


# ---- parameter counts ----


@pytest.mark.parametrize(
    "config",
    [
        tiny_config(),
        tiny_config(tie_word_embeddings=True),
        tiny_config(num_key_value_heads=4, attention_bias=True, mlp_bias=True),
        tiny_config(head_dim=24, num_key_value_heads=1),
        MistralConfig(**SMALL),
        Qwen2Config(**SMALL, num_key_value_heads=2, tie_word_embeddings=True),
        Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=32),
    ],
    ids=["llama", "llama-tied", "llama-biases", "llama-head-dim", "mistral", "qwen2-tied", "qwen3"],
)
def test_formula_matches_models_built_from_configs(config):
    model = AutoModelForCausalLM.from_config(config)
    spec = ModelSpec.from_config(config)
    assert spec.num_parameters() == sum(p.numel() for p in model.parameters())
    expanded = []
    for t in spec.tensors():
        names = [t.name.replace("*", str(i)) for i in range(t.count)] if "*" in t.name else [t.name]
        expanded += [(n, t.shape) for n in names]
    assert sorted(expanded) == sorted((n, tuple(p.shape)) for n, p in model.named_parameters())
    # The base model accelerate measures is the same without lm_head.
    assert spec.num_parameters(include_lm_head=False) == sum(p.numel() for p in model.model.parameters())


@pytest.mark.parametrize("preset", list_presets())
def test_presets_count_exactly_what_transformers_builds(preset):
    config, _, _ = resolve_config(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    spec = load_model_spec(preset)
    assert spec.num_parameters() == sum(p.numel() for p in model.parameters())
    if preset in PUBLISHED_COUNTS:
        assert spec.num_parameters() == PUBLISHED_COUNTS[preset]


def test_presets_accept_their_hub_name():
    spec = load_model_spec("meta-llama/Llama-2-70b-hf")
    assert spec.name == "llama-2-70b" and spec.num_key_value_heads == 8


# ---- gradients, sharding, accumulation ----


def test_layerwise_gradient_term_is_the_held_lm_head_next_to_the_largest_layer_tensor():
    spec = load_model_spec("llama-2-7b")
    standard = estimate(spec, optimizer="adamw_torch", dtype="bf16")
    layerwise = estimate(spec, optimizer="adamw_torch_layerwise", dtype="bf16")
    embed, mlp = 32000 * 4096 * 2, 11008 * 4096 * 2
    # The untied lm_head's step is held (its gradient alive) while a decoder layer's gradients step, one at a time.
    assert layerwise.gradient_bytes == embed + mlp and layerwise.largest_parameter_bytes == embed
    assert layerwise.largest_parameter == "model.embed_tokens.weight"
    assert standard.gradient_bytes == standard.all_gradient_bytes == 6_738_415_616 * 2
    assert standard.weight_bytes == layerwise.weight_bytes == 6_738_415_616 * 2
    assert standard.optimizer_state_bytes == layerwise.optimizer_state_bytes
    assert standard.total_bytes - layerwise.total_bytes == standard.gradient_bytes - embed - mlp


def test_held_lm_head_step_follows_the_one_process_route(tmp_path):
    from layerwise_hf.estimate.buckets import LARGE_FRACTION, held_step_bound
    from layerwise_hf.routes.hooks import LARGE_FRACTION as ROUTE_FRACTION

    assert LARGE_FRACTION == ROUTE_FRACTION
    config = tiny_config(vocab_size=512)  # lm_head and embedding 512 x 64: four times any layer tensor
    held = estimate(config, optimizer="adamw_torch_layerwise", dtype="fp32")
    lm_head, layer = 512 * 64 * 4, 128 * 64 * 4
    assert held.gradient_bytes == lm_head + layer and any("held" in n for n in held.notes)
    assert held_step_bound([8, 1, 3, 2, 8]) == (11, 8)
    # Neither GA nor the other routes hold it: every gradient, the buckets, the FSDP2 units.
    for kwargs in (dict(gradient_accumulation_steps=2), dict(world_size=2), dict(world_size=2, sharding="fsdp2")):
        other = estimate(config, optimizer="adamw_torch_layerwise", dtype="fp32", **kwargs)
        assert not any(n.startswith("One process") for n in other.notes)
    # What the route holds, counted at every gradient hook of a plain loop without clipping.
    model = LlamaForCausalLM(config)
    params = list(model.parameters())
    alive = []
    for p in params:
        p.register_post_accumulate_grad_hook(
            lambda _: alive.append(sum(q.grad.numel() * 4 for q in params if q.grad is not None))
        )
    args = LayerwiseTrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise", use_cpu=True)
    optimizer = build_layerwise_optimizer(model, args)
    optimizer.attach(sync_gradients=lambda: True)
    for _ in range(2):  # planned from parameter order, then from the order observed
        ids = torch.randint(0, config.vocab_size, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        assert max(alive) == held.gradient_bytes
        alive.clear()
    optimizer.detach()


def test_tied_embedding_gradient_is_held_through_backward():
    layerwise = estimate("llama-3.2-1b", optimizer="sgd_layerwise", dtype="bf16")
    embed = 128256 * 2048 * 2
    assert layerwise.largest_parameter == "model.embed_tokens.weight"
    assert layerwise.gradient_bytes == 2 * embed
    assert any("Tied" in n for n in layerwise.notes)


def test_gradient_accumulation_keeps_all_gradients():
    standard = estimate("mistral-7b", optimizer="adamw_torch", gradient_accumulation_steps=4)
    layerwise = estimate("mistral-7b", optimizer="adamw_torch_layerwise", gradient_accumulation_steps=4)
    assert layerwise.gradient_bytes == standard.gradient_bytes == layerwise.all_gradient_bytes
    assert estimate("mistral-7b", gradient_accumulation_steps=1).gradient_bytes < layerwise.gradient_bytes


def test_fsdp2_divides_weights_gradients_and_state():
    one = estimate("llama-3-70b", optimizer="adamw_torch")
    standard = estimate("llama-3-70b", optimizer="adamw_torch", world_size=8, sharding="fsdp2")
    assert standard.total_bytes == one.total_bytes
    assert standard.per_gpu_bytes == math.ceil(one.total_bytes / 8)
    # Layer-wise, a whole FSDP2 unit's gradient shards arrive from one reduce-scatter: here accelerate's tail unit
    # (final norm + lm_head; the input embedding is a unit of its own), larger than a decoder layer.
    layerwise = estimate("llama-3-70b", optimizer="adamw_torch_layerwise", world_size=8, sharding="fsdp2")
    tail = (128256 * 8192 + 8192) * 2
    layer = (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192) * 2
    assert layerwise.gradient_bytes == max(tail, layer) == tail
    assert layerwise.per_gpu_bytes == math.ceil((one.weight_bytes + tail + one.optimizer_state_bytes) / 8)
    assert (
        estimate("llama-2-70b", optimizer="sgd_layerwise", world_size=8, sharding="fsdp2").gradient_bytes
        == (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192) * 2
    )  # Llama-2's 32000-token vocabulary: a decoder layer is the largest unit
    refused = estimate("llama-3-70b", optimizer="adamw_torch_4bit_layerwise", world_size=8, sharding="fsdp2")
    assert any("refused under FSDP2" in n for n in refused.notes)
    for local_shards in ("adamw_8bit_layerwise", "adafactor_layerwise"):  # stepped on the local shards
        allowed = estimate("llama-3-70b", optimizer=local_shards, world_size=8, sharding="fsdp2")
        assert not any("refused" in n for n in allowed.notes)


def test_ddp_standard_keeps_bucket_buffers():
    one = estimate("llama-2-7b", optimizer="adamw_torch")
    standard = estimate("llama-2-7b", optimizer="adamw_torch", world_size=4)
    assert standard.sharding == "ddp" and standard.per_gpu_bytes == standard.total_bytes
    assert standard.gradient_bytes == 2 * one.all_gradient_bytes  # buckets + .grad
    view = estimate("llama-2-7b", optimizer="adamw_torch", world_size=4, gradient_as_bucket_view=True)
    assert view.gradient_bytes == one.all_gradient_bytes  # .grad are views of the buckets
    assert standard.ddp_in_flight_bytes is None and any("whole run" in n for n in standard.notes)


def test_ddp_layerwise_holds_only_the_buckets_in_flight():
    # The data-parallel route (no DDP wrapper): two buckets and the gradient being copied in, not all gradients.
    view = estimate("llama-2-7b", optimizer="adamw_torch", world_size=4, gradient_as_bucket_view=True)
    ddp = estimate("llama-2-7b", optimizer="adamw_torch_layerwise", world_size=4)
    assert ddp.gradient_bytes == ddp.ddp_in_flight_bytes
    assert view.gradient_bytes - ddp.gradient_bytes > 0.9 * ddp.all_gradient_bytes  # the saving is no longer 0
    # Llama-2-7b, bf16, buckets in the reverse of forward's order of use: a tensor above the cap is a bucket of its
    # own, reduced in place, so the most alive is lm_head (250 MiB) reducing while model.norm's bucket fills (then
    # both step before the last layer's down_proj; embed_tokens arrives alone at the end).
    norm, embed = 4096 * 2, 32000 * 4096 * 2
    assert ddp.gradient_bytes == norm + embed
    assert any("no persistent buckets" in n for n in ddp.notes)
    assert ddp.total_bytes == ddp.weight_bytes + ddp.gradient_bytes + ddp.optimizer_state_bytes


def test_ddp_layerwise_bound_grows_with_the_bucket_cap():
    sizes = [estimate("llama-2-7b", world_size=2, bucket_cap_mb=cap).gradient_bytes for cap in (25, 100, 400, 2000)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    # A cap above every gradient: one bucket of all of them, plus the largest gradient while it is copied in.
    one = estimate("llama-2-7b", world_size=2, bucket_cap_mb=10**6)
    assert one.gradient_bytes == one.all_gradient_bytes + one.largest_parameter_bytes
    with pytest.raises(EstimateError, match="bucket_cap_mb"):
        estimate("llama-2-7b", world_size=2, bucket_cap_mb=0)


def test_ddp_layerwise_with_gradient_accumulation_keeps_every_gradient():
    ga = estimate("llama-2-7b", optimizer="adamw_torch_layerwise", world_size=2, gradient_accumulation_steps=4)
    assert ga.gradient_bytes == ga.all_gradient_bytes and ga.ddp_in_flight_bytes is None
    assert any("accumulation" in n for n in ga.notes)


def test_ddp_buckets_match_torch_assignment():
    import random

    import torch.distributed as dist

    from layerwise_hf.estimate.buckets import assign_buckets, bucket_size_limits

    rng = random.Random(0)
    for limits in (bucket_size_limits(), bucket_size_limits(0.5), [1000, 5000]):
        numels = [rng.choice([1, 64, 4096, 70_000, 300_000, 3_000_000]) for _ in range(60)]
        tensors = [torch.empty(n, device="meta") for n in numels]
        expected, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors))
        ours = assign_buckets([4 * n for n in numels], limits, large_alone=False)
        assert [b.sizes for b in ours] == [tuple(4 * numels[i] for i in b) for b in expected]


def test_ddp_buckets_are_the_routes_buckets():
    # The estimator's buckets are the ones the data-parallel route builds (layerwise_hf.routes.data_parallel).
    import random

    from layerwise_hf.estimate.buckets import assign_buckets, bucket_size_limits
    from layerwise_hf.routes.data_parallel import build_buckets

    rng = random.Random(1)
    for limits in (bucket_size_limits(), bucket_size_limits(0.5), [1000, 5000], [5000]):
        for _ in range(20):
            numels = [rng.choice([1, 64, 1000, 4096, 70_000, 300_000, 3_000_000]) for _ in range(40)]
            tensors = [torch.empty(n, device="meta") for n in numels]
            route = build_buckets(tensors, limits, list(range(len(tensors))))
            ours = assign_buckets([4 * n for n in numels], limits)
            assert [b.sizes for b in ours] == [tuple(4 * n for n in b.numels) for b in route]
            assert [b.alone for b in ours] == [b.alone for b in route]  # the buckets whose step may be held


def test_ddp_layerwise_bound_on_the_58m_benchmark_model():
    # benchmarks/distributed_memory.py's model, bucketed as the route does in the reverse of forward's order of use:
    # lm_head and embed_tokens (62.5 MiB each) are buckets of their own, reduced in place; lm_head's step is held
    # while the decoder layers' buckets reduce, two at a time, and comes before embed_tokens' gradient exists.
    import torch.distributed as dist

    from layerwise_hf.estimate.buckets import DEFAULT_FIRST_BUCKET_BYTES
    from layerwise_hf.estimate.models import forward_use_order

    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)  # fmt: skip
    est = estimate(config, optimizer="adamw_torch_layerwise", dtype="float32", world_size=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    named = dict(model.named_parameters())
    ready = [named[n] for n in reversed(forward_use_order(model))]
    assert len(ready) == len(named) and DEFAULT_FIRST_BUCKET_BYTES == dist._DEFAULT_FIRST_BUCKET_BYTES
    from layerwise_hf.routes.data_parallel import build_buckets

    assignment = [
        b.indices for b in build_buckets(ready, [DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20], list(range(len(ready))))
    ]
    sizes = [sum(ready[i].numel() * 4 for i in b) for b in assignment]
    copies = [max(ready[i].numel() * 4 for i in b) if len(b) > 1 else 0 for b in assignment]
    assert len(assignment) == 6 and len(assignment[0]) == len(assignment[-1]) == 1  # lm_head, 4 buckets, embed_tokens
    held = sizes[0]
    bound = held + max(sizes[k - 1] + sizes[k] + copies[k] for k in range(2, len(sizes) - 1))
    assert est.gradient_bytes == bound == est.ddp_in_flight_bytes
    # What benchmarks/distributed_memory.py counted on each rank (grads live, results/distributed_memory.json).
    assert round(bound / 2**20, 1) == 118.8 and round(est.all_gradient_bytes / 2**20, 1) == 221.5
    assert any("62.50 MiB + 26.82 MiB + 26.82 MiB + 2.69 MiB" in n for n in est.notes)


def test_ddp_in_flight_bound_replays_the_routes_holds():
    from layerwise_hf.estimate.buckets import Bucket, ddp_in_flight_bound

    large, small = Bucket((100,), alone=True), Bucket((10, 20))
    # Without a held bucket: the one reducing, the one filling, the gradient copied in.
    assert ddp_in_flight_bound([small, small, small]) == (30 + 30 + 20, 1, 0)
    # A large bucket followed by smaller ones is held while they reduce; it steps (with the one in flight) before the
    # next large gradient exists, so that one arrives alone.
    assert ddp_in_flight_bound([large, small, small, small, large]) == (100 + 30 + 30 + 20, 2, 100)
    # Large buckets in a row are never held: each steps when the next one is launched, as before.
    assert ddp_in_flight_bound([large, large, large]) == (200, 1, 0)
    assert ddp_in_flight_bound([large, small]) == (100 + 30 + 20, 1, 0)


# ---- optimizer state against the real optimizers ----

OPTIMIZERS = [
    "adamw_torch",
    "sgd",
    "adagrad",
    "rmsprop",
    "adafactor",
    "adamw_8bit",
    "paged_adamw_32bit",
    "lion_8bit",
    "lion_32bit",
    "rmsprop_bnb_8bit",
    "ademamix_8bit",
    "muon",  # Muon for the hidden matrices, AdamW for the rest (muon_layerwise)
    *[
        name
        for name, package in (
            ("adamw_torch_8bit", "torchao"),
            ("adamw_torch_4bit", "torchao"),
            ("stable_adamw", "optimi"),
        )
        if importlib.util.find_spec(package)
    ],
]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU:UserWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_state_bytes_match_the_layerwise_optimizer(tmp_path, tie, dtype):
    config = tiny_config(tie_word_embeddings=tie)
    for name in OPTIMIZERS:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(dtype)
        args = LayerwiseTrainingArguments(
            output_dir=str(tmp_path), optim=f"{name}_layerwise", use_cpu=True, report_to="none"
        )
        optimizer = build_layerwise_optimizer(model, args)
        optimizer.attach()
        ids = torch.randint(0, config.vocab_size, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.detach()
        from_config = estimate(config, optimizer=f"{name}_layerwise", dtype=str(dtype).removeprefix("torch."))
        from_model = estimate(model, optimizer=f"{name}_layerwise")
        assert (
            from_config.optimizer_state_bytes
            == from_model.optimizer_state_bytes
            == optimizer.pipeline.memory.state_bytes()
        ), name
        assert from_config.weight_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
        assert from_config.all_gradient_bytes == optimizer.pipeline.memory.full_grad_bytes()


def test_lora_estimate_matches_peft(tmp_path):
    from peft import LoraConfig, get_peft_model

    config = tiny_config()
    targets = ["q_proj", "v_proj", "down_proj"]
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    est = estimate(config, optimizer="adamw_torch_layerwise", dtype="fp32", lora_rank=4, lora_target_modules=targets)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert est.num_trainable_parameters == sum(p.numel() for p in trainable)
    assert est.num_parameters == sum(p.numel() for p in model.parameters())
    assert est.largest_parameter_bytes == max(p.numel() * 4 for p in trainable)
    args = LayerwiseTrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise", use_cpu=True)
    optimizer = build_layerwise_optimizer(model, args)
    optimizer.attach()
    ids = torch.randint(0, config.vocab_size, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.detach()
    assert est.optimizer_state_bytes == optimizer.pipeline.memory.state_bytes()
    assert (
        estimate(model, optimizer="adamw_torch_layerwise").optimizer_state_bytes
        == optimizer.pipeline.memory.state_bytes()
    )


def test_lora_on_a_quantized_base_counts_adapters_only():
    full = estimate("llama-2-70b", optimizer="adamw_torch", dtype="bf16")
    qlora = estimate("llama-2-70b", dtype="bf16", lora_rank=16, lora_target_modules=["all-linear"], frozen_dtype="nf4")
    assert qlora.num_trainable_parameters < 0.01 * full.num_trainable_parameters
    assert qlora.weight_bytes < 0.35 * full.weight_bytes
    with pytest.raises(EstimateError, match="gate"):
        estimate("llama-2-7b", lora_rank=8, lora_target_modules=["gate"])


# ---- inputs ----


def test_config_json_path_and_directory(tmp_path):
    values = {k: v for k, v in PRESETS["llama-2-7b"].items() if k != "source"}
    LlamaConfig(**values).to_json_file(tmp_path / "config.json")
    preset = estimate("llama-2-7b", dtype="bf16")
    for source in (tmp_path, tmp_path / "config.json", str(tmp_path / "config.json")):
        from_file = estimate(source, dtype="bf16")
        assert from_file.num_parameters == preset.num_parameters == PUBLISHED_COUNTS["llama-2-7b"]
        assert from_file.total_bytes == preset.total_bytes


def test_config_json_of_an_architecture_without_formula(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300)
    config.to_json_file(tmp_path / "config.json")
    est = estimate(tmp_path, optimizer="adamw_torch_layerwise", dtype="fp32")
    assert est.num_parameters == sum(p.numel() for p in GPT2LMHeadModel(config).parameters())


def test_bad_inputs_name_the_choices(tmp_path):
    with pytest.raises(EstimateError, match="llama-2-70b"):
        estimate("llama-9-7b")
    with pytest.raises(EstimateError, match="adamw_8bit"):
        estimate("llama-2-7b", optimizer="adamw_9bit_layerwise")
    with pytest.raises(EstimateError, match="muon_layerwise"):
        estimate("llama-2-7b", optimizer="muon")  # no standard Trainer form
    with pytest.raises(EstimateError, match="fp32/bf16/fp16"):
        estimate("llama-2-7b", dtype="fp8")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(EstimateError, match="JSON"):
        estimate(tmp_path)


# ---- data files ----


def test_presets_are_config_json_files():
    files = sorted(PRESETS_DIR.glob("*.json"))
    assert [f.stem for f in files] == list_presets()
    for path in files:
        values = json.loads(path.read_text())
        # What a config.json holds: transformers builds the config from it as it is; `_name_or_path` names the repo.
        config, name, source = resolve_config(path.stem)
        assert config.model_type == values["model_type"] and source == values["_name_or_path"]
        assert type(config).__name__.removesuffix("Config") in values["architectures"][0]
        assert PRESETS[path.stem]["source"] == values["_name_or_path"]


def test_optimizer_rules_are_data_and_fsdp2_comes_from_support():
    assert load_rules(RULES_FILE) == OPTIMIZER_RULES
    assert {n for n, r in OPTIMIZER_RULES.items() if r.fsdp2} == {
        *support.FSDP2_ELEMENTWISE,
        *support.FSDP2_DTENSOR_NATIVE,
        *support.FSDP2_LOCAL_SHARD,
    }
    assert all(r.name == n for n, r in OPTIMIZER_RULES.items())


def test_fsdp2_refusal_note_is_supports_message():
    assert fsdp2_refusal("adamw_torch") is None
    refused = estimate("llama-3-8b", optimizer="adamw_torch_4bit_layerwise", world_size=2, sharding="fsdp2")
    (note,) = [n for n in refused.notes if "refused under FSDP2" in n]
    with pytest.raises(ValueError) as raised:
        support.check_fsdp2_optimizers("adamw_torch_4bit_layerwise", [type("adamw_torch_4bit", (), {})()])
    assert note.endswith(str(raised.value))
    allowed = estimate("llama-3-8b", optimizer="sgd_layerwise", world_size=2, sharding="fsdp2")
    assert not any("refused" in n for n in allowed.notes)


def test_meta_device_spec_folds_identical_layers_only():
    same = [TensorSpec(f"model.layers.{i}.mlp.up_proj.weight", (8, 4), module="up_proj") for i in range(3)]
    (folded,) = collapse_layers(same)
    assert folded.name == "model.layers.*.mlp.up_proj.weight" and folded.count == 3
    # One layer of another shape: every layer keeps its own entry, in order.
    mixed = [*same[:2], TensorSpec("model.layers.2.mlp.up_proj.weight", (16, 4), module="up_proj")]
    assert collapse_layers(mixed) == mixed
    # A name only some layers have is kept per layer too.
    partial = [*same, TensorSpec("model.layers.0.extra.weight", (2,), module="extra")]
    assert [t.count for t in collapse_layers(partial)] == [3, 1]


def test_config_of_any_architecture_honours_dtype(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300).to_json_file(tmp_path / "config.json")
    fp32 = estimate(tmp_path, optimizer="adamw_torch", dtype="fp32")
    bf16 = estimate(tmp_path, optimizer="adamw_torch", dtype="bf16")
    assert bf16.dtype == "bfloat16" and 2 * bf16.weight_bytes == fp32.weight_bytes


def test_forward_use_order_survives_use_cache_off():
    # Trainer sets use_cache=False on the model's config; the meta forward must still give the order of use, or the
    # DDP buckets (and the in-flight bound) would follow parameter order instead of the route's.
    from layerwise_hf.estimate.models import forward_use_order

    orders = []
    for use_cache in (True, False):
        config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, use_cache=use_cache)  # fmt: skip
        with torch.device("meta"):
            orders.append(forward_use_order(LlamaForCausalLM(config)))
    assert orders[0] == orders[1] and orders[0][1] == "model.layers.0.input_layernorm.weight"


def test_fsdp2_units_follow_accelerates_wrapping():
    import dataclasses

    # accelerate 1.15 shards an untied input embedding and the final norm + lm_head as units of their own, so on the
    # 58M benchmark model the largest unit is one 62.5 MiB tensor: 31.3 MiB per rank on 2 ranks, what
    # benchmarks/distributed_memory.py counted (results/distributed_memory_fsdp2.json, .grad storages).
    from layerwise_hf.estimate.core import _fsdp2_unit

    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)  # fmt: skip
    est = estimate(config, optimizer="adamw_8bit_layerwise", dtype="float32", world_size=2, sharding="fsdp2")
    per_rank = [round(x / 2 / 2**20, 1) for x in (est.gradient_bytes, est.optimizer_state_bytes)]
    assert per_rank == [31.3, 103.0]
    assert any("(12.07 MiB per decoder layer)" in n for n in est.notes)
    embed = TensorSpec("model.embed_tokens.weight", (8, 4), module="embed_tokens", is_embedding=True)
    assert _fsdp2_unit(embed) == "embed"
    assert _fsdp2_unit(TensorSpec("lm_head.weight", (8, 4), module="lm_head")) == "tail"
    assert _fsdp2_unit(TensorSpec("model.norm.weight", (4,), module="norm")) == "tail"
    # A tied embedding goes with lm_head's use of it, into the tail.
    assert _fsdp2_unit(dataclasses.replace(embed, tied=True)) == "tail"
    assert _fsdp2_unit(TensorSpec("model.layers.*.mlp.up_proj.weight", (8, 4), module="up_proj")) != "root"


@pytest.mark.parametrize("base", ["grokadamw", "lomo"])
def test_refused_layerwise_bases_are_refused_with_trainings_reason(base):
    with pytest.raises(EstimateError, match=f"{base}_layerwise is refused, as training refuses it: .*"):
        estimate("llama-2-7b", optimizer=f"{base}_layerwise")
    if base == "grokadamw":
        assert estimate("llama-2-7b", optimizer="grokadamw").optimizer_state_bytes > 0  # the standard form is fine
