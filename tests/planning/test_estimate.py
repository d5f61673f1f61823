"""The analytic plan: figures, chip verdicts, alignment flags, the report, and agreement with
XLA's buffer assignment for the hand-written JAX reference step."""

import pytest

from tests.parallel import jax_reference as ref
from tpu_train.compile.program import compiled_analysis
from tpu_train.models import LLAMA, flops_per_token, get_config, num_params
from tpu_train.parallel import build_mesh, sharding_plan
from tpu_train.parallel.mesh import MeshError
from tpu_train.planning import (CHIPS, alignment_warnings, estimate, estimate_from_config,
                                format_report)
from tpu_train.planning.estimate import GiB

# Small enough to compile in seconds, large enough that activations are not noise.
SMALL = get_config("debug_tiny", dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                   ffn_hidden_dim=384)


def test_chip_table():
    assert {k: (c.hbm_bytes // GiB, c.bf16_tflops) for k, c in CHIPS.items()} == {
        "v4": (32, 275.0), "v5e": (16, 197.0), "v5p": (95, 459.0), "v6e": (32, 918.0),
        "v7": (192, 2307.0)}


def test_fsdp_divides_the_sharded_state():
    cfg = get_config("llama3_1_8b")
    one = estimate(cfg, num_devices=1, data=1, batch=1, seq_len=1024)
    eight = estimate(cfg, num_devices=8, data=1, fsdp=8, batch=8, seq_len=1024)
    assert one["bytes_params"] == num_params(cfg) * 4
    assert one["bytes_optimizer"] == 2 * one["bytes_params"]  # two fp32 AdamW moments
    for key in ("bytes_params", "bytes_grads", "bytes_optimizer"):
        assert eight[key] == pytest.approx(one[key] / 8, rel=1e-6)
    ckpt = estimate(cfg, num_devices=8, data=1, fsdp=8, batch=8, seq_len=1024,
                    activation_checkpointing=True)
    assert ckpt["bytes_activations"] < eight["bytes_activations"] / 4
    assert ckpt["bytes_fsdp_gathered"] < eight["bytes_fsdp_gathered"] / 4
    # with checkpointing, the larger phase: the head gathered with its gradient unreduced and
    # a layer prefetched (the 8B's), or two layers gathered and one layer's gradient
    head = cfg.vocab_size * cfg.dim
    layer = (num_params(cfg) - 2 * head - cfg.dim) // cfg.n_layers
    assert 2 * head + layer > 3 * layer
    assert ckpt["bytes_fsdp_gathered"] == 4 * (2 * head + layer)
    flash = estimate(cfg, num_devices=8, data=1, fsdp=8, batch=8, seq_len=1024,
                     flash_attention=True, act_bytes=2)
    assert flash["bytes_activations"] < eight["bytes_activations"] / 2


def test_scanned_layers_gather_one_layer_at_a_time_and_keep_projections():
    cfg = get_config("llama3_1_8b")
    args = dict(num_devices=8, data=1, fsdp=8, batch=8, seq_len=1024)
    unrolled = estimate(cfg, **args)
    scanned = estimate(cfg, scan_layers=True, **args)
    ckpt = estimate(cfg, activation_checkpointing=True, **args)
    # Gathered inside the loop, a layer at a time. The peak is the larger of two phases, here
    # the first layer's backward: that layer's gathered weights and unreduced gradient, the
    # stacked gradients, one layer's full activations; no loss head.
    head = cfg.vocab_size * cfg.dim
    layers = num_params(cfg) - 2 * head - cfg.dim
    layer = layers // cfg.n_layers
    assert scanned["peak_phase"] == "the first layer's backward"
    assert scanned["bytes_fsdp_gathered"] == 4 * 2 * layer
    assert scanned["bytes_grads"] == unrolled["bytes_grads"] and scanned["bytes_loss_head"] == 0
    assert ckpt["bytes_fsdp_gathered"] == 4 * (2 * head + layer) and ckpt["peak_phase"] is None
    # Over 256 chips, one sequence of 128 tokens each: the layers' gradients are small and
    # FSDP's head phase (the gathered head and its gradient) is the larger one.
    short = estimate(cfg, scan_layers=True, num_devices=256, data=1, fsdp=256, batch=256,
                     seq_len=128)
    assert short["peak_phase"] == "the head's backward" and short["bytes_grads"] == 0
    assert short["bytes_fsdp_gathered"] == 4 * 2 * head
    # The stack's copy of the layers' local shards: 1/8 of the layers' weights, fp32.
    assert scanned["bytes_stacked_layers"] == pytest.approx(4 * layers / 8, rel=1e-6)
    assert unrolled["bytes_stacked_layers"] == 0
    # Per layer only the input and the projections' outputs: between checkpointed and not.
    assert ckpt["bytes_activations"] < scanned["bytes_activations"] \
        < unrolled["bytes_activations"] / 3
    assert scanned["bytes_total"] == sum(scanned[k] for k in (
        "bytes_params", "bytes_grads", "bytes_optimizer", "bytes_grad_accumulator",
        "bytes_fsdp_gathered", "bytes_stacked_layers", "bytes_activations", "bytes_loss_head"))


def test_step_time_and_fit_verdict():
    cfg = get_config("llama3_1_70b")
    r = estimate(cfg, num_devices=256, data=1, fsdp=256, batch=256, seq_len=4096, chip="v5p",
                 activation_checkpointing=True, mfu=0.5)
    flops = flops_per_token(cfg, 4096) * 256 * 4096
    assert r["model_flops_per_step"] == flops
    assert r["step_time_s"] == pytest.approx(flops * 4 / 3 / 256 / (459e12 * 0.5))
    assert r["assumed_mfu"] == 0.5 and r["fits"] is True
    small = estimate(cfg, num_devices=8, data=1, fsdp=8, batch=8, seq_len=4096, chip="v5e")
    assert small["fits"] is False and small["hbm_use_fraction"] > 1
    with pytest.raises(ValueError, match="unknown TPU generation 'v9'"):
        estimate(cfg, num_devices=8, fsdp=8, data=1, batch=8, seq_len=8, chip="v9")
    with pytest.raises(ValueError, match="global batch 4 must be a multiple of data \\* fsdp"):
        estimate(cfg, num_devices=8, fsdp=8, data=1, batch=4, seq_len=8)
    with pytest.raises(MeshError, match="does not divide n_kv_heads=8"):
        estimate(cfg, num_devices=16, data=1, tensor=16, batch=1, seq_len=8)


def test_estimate_from_the_tpu_train_config():
    from omegaconf import OmegaConf

    from tpu_train.trainer.config import Config

    config = OmegaConf.structured(Config)
    config.data.path = None
    config.model.name = "llama3_2_1b"
    config.parallel.data, config.parallel.fsdp = 1, 8
    config.data.batch_size, config.data.seq_len = 8, 2048
    config.trainer.grad_accum_steps = 4
    config.plan.chip = "v6e"
    r = estimate_from_config(config)
    assert r["num_devices"] == 8 and r["chip"] == "v6e"
    assert r["tokens_per_step"] == 8 * 2048 * 4
    assert r["bytes_grad_accumulator"] == r["bytes_params"]
    config.parallel.data = -1
    with pytest.raises(ValueError, match="planning needs the chip count"):
        estimate_from_config(config)
    config.data.batch_size = 16  # the global micro-batch splits over data * fsdp = 16
    assert estimate_from_config(config, num_devices=16)["mesh"]["data"] == 2


def test_one_tpu_chip_keeps_no_attention_scores_from_the_kernels_length():
    """On a TPU the step's attention runs the kernels from 1,024 tokens in bf16
    (tpu_train.ops.attention_tpu), on one chip or on each chip of a partitioned step: the
    estimate keeps no seq x seq scores there; at shorter lengths or in float32 it does."""
    from omegaconf import OmegaConf

    from tpu_train.trainer.config import Config

    config = OmegaConf.structured(Config)
    config.data.path = None
    config.model.name, config.model.max_seq_len = "llama_1b", 8192
    config.parallel.data = 1
    config.data.batch_size, config.data.seq_len = 1, 8192
    config.trainer.precision, config.plan.chip = "bf16", "v5e"
    fused = estimate_from_config(config)
    assert fused["flash_attention"]
    config.data.seq_len = 512
    assert not estimate_from_config(config)["flash_attention"]
    config.data.seq_len, config.trainer.precision = 8192, "fp32"
    assert not estimate_from_config(config)["flash_attention"]
    config.trainer.precision, config.parallel.fsdp, config.data.batch_size = "bf16", 2, 2
    assert estimate_from_config(config)["flash_attention"]  # per chip, in a shard_map


def test_alignment_flags_name_the_config_key():
    assert alignment_warnings(get_config("llama3_1_8b")) == []  # vocab 128256 = 1002 * 128
    warnings = alignment_warnings(get_config("debug_tiny", vocab_size=500))  # head_dim 64
    assert len(warnings) == 2
    assert "model.vocab_size=500" in warnings[0] and "LlamaConfig.vocab_size to 512" in warnings[0]
    assert "head_dim = dim / n_heads = 64" in warnings[1]
    from tpu_train.parallel.mesh import MeshShape

    shard = alignment_warnings(get_config("llama3_1_8b"), MeshShape(1, 64, 1))
    assert any("dim / fsdp = 64" in w for w in shard)


@pytest.mark.devices(8)
@pytest.mark.parametrize("degrees", [(1, 8, 1), (1, 4, 2)])
def test_analytic_memory_within_10_percent_of_xla(degrees):
    batch, seq = 32, 64
    mesh = build_mesh(*degrees, split_sizes=LLAMA.split_sizes(SMALL))
    plan = sharding_plan(LLAMA)
    step = ref.make_train_step(SMALL, mesh, plan)
    xla = compiled_analysis(step.lower(*ref.abstract_inputs(SMALL, batch, seq, mesh, plan))
                            .compile())
    analytic = estimate(SMALL, num_devices=8, data=degrees[0], fsdp=degrees[1],
                        tensor=degrees[2], batch=batch, seq_len=seq)
    assert analytic["bytes_total"] == pytest.approx(xla["bytes_peak_estimate"], rel=0.10)
    # Arguments are exactly the sharded parameters, both moments, the step count and batch.
    state = analytic["bytes_params"] + analytic["bytes_optimizer"]
    batch_shards = degrees[0] * degrees[1]
    assert xla["argument_size_in_bytes"] == state + 4 + 2 * batch * seq * 4 // batch_shards
    assert xla["flops_per_device"] > 0


def test_the_report_names_the_assumption_and_the_compiler():
    result = estimate(get_config("llama3_1_8b"), num_devices=8, data=1, fsdp=8, batch=8,
                      seq_len=2048, chip="v5p")
    text = format_report(result)
    assert "assumed MFU of 40 %" in text and "XLA" not in text
    result["notes"] = ["libtpu is not installed (...): XLA's figures are the CPU compiler's"]
    result["xla"] = {"bytes_peak_estimate": 3 * GiB, "argument_size_in_bytes": GiB,
                     "temp_size_in_bytes": 2 * GiB, "flops_per_device": 2.0e15,
                     "compiler": "CPU"}
    result["xla_vs_analytic"], result["xla_flops_vs_analytic"] = -0.25, 0.03
    lines = format_report(result).splitlines()
    assert lines[0].startswith("note: libtpu is not installed")
    assert "XLA (CPU compiler, 8 virtual CPU devices): 3.00 GiB per chip" in lines[-2]
    assert lines[-1] == "XLA vs analytic per chip: memory -25.0 %, FLOPs +3.0 %"
    result["xla"].update(compiler="TPU", compiled_for="v5p:2x2x2")
    assert "XLA (TPU compiler, v5p:2x2x2): 3.00 GiB" in format_report(result)


def test_context_parallelism_divides_the_tokens_and_adds_the_gathered_keys():
    cfg = get_config("llama3_1_8b")
    args = dict(num_devices=64, data=1, fsdp=16, batch=16, seq_len=32768, act_bytes=2,
                remat="full", flash_attention=True)
    whole = estimate(cfg, **{**args, "num_devices": 16})
    split = estimate(cfg, context=4, **args)
    assert split["mesh"]["context"] == 4
    # Weights are stored over fsdp x context (tpu_train.parallel.plans.over_context).
    for key in ("bytes_params", "bytes_grads", "bytes_optimizer"):
        assert split[key] == pytest.approx(whole[key] / 4, rel=1e-6)
    # Per chip a quarter of each sequence's tokens; their scores still span the sequence.
    assert split["bytes_activations"] == pytest.approx(whole["bytes_activations"] / 4, rel=1e-6)
    assert split["bytes_loss_head"] == pytest.approx(whole["bytes_loss_head"] / 4, rel=1e-6)
    # One layer's keys and values of the whole sequence, and their gradients: one row each
    # of 32768 tokens x 2 x 8 kv heads x 128, bf16.
    gathered = 32768 * 2 * cfg.n_kv_heads * cfg.head_dim * 2
    assert split["bytes_context_kv"] == 2 * gathered and whole["bytes_context_kv"] == 0
    # Forward gather, backward reduce-scatter, recomputation's gather: 3 of 4 parts arrive.
    assert split["context_kv_gather_bytes"] == 3 * cfg.n_layers * gathered * 3 // 4
    assert "received per chip per step" in format_report(split)
    with pytest.raises(ValueError, match="2 x context = 8 equal chunks"):
        estimate(cfg, context=4, **{**args, "seq_len": 32764})


def test_mixtral_memory_counts_every_expert_and_splits_them_over_the_expert_axis():
    from tpu_train.models import MIXTRAL

    cfg = MIXTRAL.config("mixtral_8x7b")
    num_params, flops_per_token = MIXTRAL.num_params, MIXTRAL.flops_per_token
    result = estimate(cfg, num_devices=8, data=1, fsdp=2, expert=4, batch=8, seq_len=512)
    assert result["mesh"]["expert"] == 4 and result["num_params"] == num_params(cfg)
    experts = 32 * 3 * 8 * 14336 * 4096  # w1, w2, w3 of 8 experts in 32 layers
    rest = num_params(cfg) - experts  # split over fsdp only (the routers too, as norms are)
    assert result["bytes_params"] == 4 * (experts // 8 + rest // 2)
    # FLOPs by active parameters: 2 of the 8 experts per token.
    assert result["model_flops_per_step"] == flops_per_token(cfg, 512) * 8 * 512
    with pytest.raises(MeshError, match="must divide the model's n_experts=8"):
        estimate(cfg, num_devices=16, data=1, fsdp=1, expert=16, batch=16, seq_len=512)


def test_a_float32_step_that_does_not_fit_is_offered_bf16_compute():
    """Llama-3.1-8B at 8,192 tokens on a v5e-256 in float32 without remat needs ~5x a chip:
    among the settings that would fit are steps computed in bf16 (half the activations, the
    attention kernels), whose estimate keeps no scores; a bf16 step is not offered it again."""
    from omegaconf import OmegaConf

    from tpu_train.planning.fit import fitting_candidates
    from tpu_train.trainer.config import Config

    config = OmegaConf.structured(Config)
    config.data.path = None
    config.model.name, config.plan.chip = "llama3_1_8b", "v5e"
    config.parallel.data, config.parallel.fsdp = 1, 256
    config.data.batch_size, config.data.seq_len = 256, 8192
    needed = estimate_from_config(config)["bytes_total"]
    usable = 14.4 * GiB
    found = fitting_candidates(config, needed, usable, 256, more_chips=False, most=50,
                               precision=True)
    assert not any("trainer.precision" in c.changes  # the trainer's out-of-memory advice
                   for c in fitting_candidates(config, needed, usable, 256, most=50))
    bf16 = [c for c in found if c.changes.get("trainer.precision") == "bf16"]
    assert bf16 and all(c.predicted_bytes <= usable for c in found)
    assert estimate_from_config(config, changes=bf16[0].changes)["flash_attention"]
    config.trainer.precision = "bf16"
    needed = estimate_from_config(config)["bytes_total"]
    assert not any("trainer.precision" in c.changes
                   for c in fitting_candidates(config, needed, usable, 256, most=50,
                                               precision=True))


def test_offload_keeps_no_layer_input_on_the_chip():
    cfg = get_config("llama_1b")
    args = dict(num_devices=1, batch=1, seq_len=32768, act_bytes=2, flash_attention=True,
                scan_layers=True)
    full = estimate(cfg, remat="full", **args)
    offload = estimate(cfg, remat="offload", **args)
    # full keeps each layer's input (32768 x dim, bf16) on the chip; offload in host memory.
    inputs = cfg.n_layers * 32768 * cfg.dim * 2
    assert full["bytes_activations"] - offload["bytes_activations"] == inputs
    assert offload["hardware_flops_per_chip"] == full["hardware_flops_per_chip"]


def test_when_only_host_memory_makes_room_the_planner_offers_offload_with_scanned_layers():
    """The 1B at 1 x 32,768 on one v5e (bf16 weights and moments): no remat policy on the chip
    fits, each layer's input in host memory does; the candidate scans the layers, as offload
    needs. An eager run is never offered it (the policy lives in the compiled step)."""
    from omegaconf import OmegaConf

    from tpu_train.planning.fit import fitting_candidates
    from tpu_train.trainer.config import Config

    config = OmegaConf.structured(Config)
    config.data.path = None
    config.model.name, config.model.max_seq_len, config.plan.chip = "llama_1b", 32768, "v5e"
    config.parallel.data = 1
    config.data.batch_size, config.data.seq_len = 1, 32768
    config.trainer.precision, config.trainer.param_dtype = "bf16", "bf16"
    config.optim.state_dtype = "bf16"
    full = min(estimate_from_config(config, changes={"trainer.remat": "full",
                                                     "trainer.scan_layers": scan})["bytes_total"]
               for scan in (True, False))
    offload = estimate_from_config(config, changes={"trainer.remat": "offload",
                                                    "trainer.scan_layers": True})["bytes_total"]
    assert offload < full
    capacity = (offload + full) / 2  # room for offload's step, not for full's, scanned or not
    needed = estimate_from_config(config)["bytes_total"]
    found = fitting_candidates(config, needed, capacity, 1, more_chips=False, most=50)
    assert found and all(c.predicted_bytes <= capacity for c in found)
    offloaded = [c for c in found if c.changes.get("trainer.remat") == "offload"]
    assert offloaded and all(c.changes["trainer.scan_layers"] is True for c in offloaded)
    assert not any(c.changes.get("trainer.remat") == "full" for c in found)
    config.trainer.mode = "eager"
    assert not any(c.changes.get("trainer.remat") == "offload"
                   for c in fitting_candidates(config, needed, capacity, 1, more_chips=False,
                                               most=50))
