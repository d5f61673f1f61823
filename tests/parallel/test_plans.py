"""The Llama family's sharding plan (derived from its parameter roles): specs per parameter,
shardings per layout, placement and errors."""

import jax
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpu_train.models import LLAMA, Llama, get_config, param_shapes
from tpu_train.parallel import (BATCH_AXES, ActivationRule, PlanError, ShardingPlan, build_mesh,
                                constrain, per_device_bytes, sharding_plan)

COLUMN = P(("tensor", "fsdp"), None)
ROW = P("fsdp", "tensor")
EXPECTED = {
    "tok_embeddings.weight": COLUMN,
    "layers.0.attention.wq.weight": COLUMN,
    "layers.0.attention.wk.weight": COLUMN,
    "layers.0.attention.wv.weight": COLUMN,
    "layers.0.attention.wo.weight": ROW,
    "layers.0.feed_forward.w1.weight": COLUMN,
    "layers.0.feed_forward.w2.weight": ROW,
    "layers.0.feed_forward.w3.weight": COLUMN,
    "layers.0.attention_norm.weight": P("fsdp"),
    "layers.0.ffn_norm.weight": P("fsdp"),
    "norm.weight": P("fsdp"),
    "output.weight": COLUMN,
}


@pytest.fixture(scope="module")
def tiny_model():
    with torch.device("meta"):
        return Llama(get_config("debug_tiny"))


def test_every_llama_parameter_has_the_documented_spec(tiny_model):
    specs = sharding_plan(LLAMA).specs(tiny_model.named_parameters())
    assert set(specs) == {n for n, _ in tiny_model.named_parameters()}
    for name, spec in EXPECTED.items():
        assert specs[name] == spec, name
    # A wrapper's prefix (torch.compile's _orig_mod., a parent module) does not matter.
    assert sharding_plan(LLAMA).spec_for("_orig_mod.layers.3.feed_forward.w2.weight") == ROW
    # The reference JAX step uses exactly the model's names and shapes.
    assert param_shapes(tiny_model.config) == {n: tuple(p.shape)
                                               for n, p in tiny_model.named_parameters()}


@pytest.mark.devices(8)
def test_qkv_biases_are_split_as_their_weights_rows():
    """Qwen2's q/k/v biases are split as their weights' rows: each device holds the bias of
    the output rows it computes."""
    with torch.device("meta"):
        model = Llama(get_config("qwen2_5_0_5b", n_layers=1))
    specs = sharding_plan(LLAMA).specs(model.named_parameters())
    assert specs["layers.0.attention.wk.bias"] == P(("tensor", "fsdp"))
    shardings = sharding_plan(LLAMA).shardings(model.named_parameters(), build_mesh(1, 4, 2))
    # wq: 896 rows split 8 ways; wk: 128 rows (2 kv heads of 64) split 8 ways too.
    for name, rows in (("wq", 896), ("wk", 128)):
        weight = shardings[f"layers.0.attention.{name}.weight"].shard_shape((rows, 896))
        bias = shardings[f"layers.0.attention.{name}.bias"].shard_shape((rows,))
        assert bias == (weight[0],) == (rows // 8,)


@pytest.mark.parametrize("fsdp, tensor, wq, wo, norm", [
    (True, False, P(("fsdp",), None), P("fsdp", None), P("fsdp")),
    (False, True, P(("tensor",), None), P(None, "tensor"), P(None)),
    (False, False, P(None, None), P(None, None), P(None)),
])
def test_layouts_drop_axes(fsdp, tensor, wq, wo, norm):
    plan = sharding_plan(LLAMA, fsdp=fsdp, tensor=tensor)
    assert plan.spec_for("layers.1.attention.wq.weight") == wq
    assert plan.spec_for("layers.1.attention.wo.weight") == wo
    assert plan.spec_for("norm.weight") == norm
    assert plan.activation("heads")[1] == ("tensor" if tensor else None)


@pytest.mark.devices(8)
@pytest.mark.parametrize("degrees, local_wq, local_wo", [
    ((1, 8, 1), (32, 256), (32, 256)),      # FSDP=8: leading dimension split 8 ways
    ((1, 4, 2), (32, 256), (64, 128)),      # TP=2 x FSDP=4: wq rows over tensor x fsdp
    ((2, 2, 2), (64, 256), (128, 128)),     # DP=2 x FSDP=2 x TP=2
    ((8, 1, 1), (256, 256), (256, 256)),    # pure data parallelism: replicated
])
def test_shardings_per_layout(tiny_model, degrees, local_wq, local_wo):
    mesh = build_mesh(*degrees)
    shardings = sharding_plan(LLAMA).shardings(tiny_model.named_parameters(), mesh)
    wq = shardings["layers.0.attention.wq.weight"]
    assert wq.shard_shape((256, 256)) == local_wq
    assert shardings["layers.0.attention.wo.weight"].shard_shape((256, 256)) == local_wo


@pytest.mark.devices(8)
def test_place_gives_inspectable_global_arrays_and_divides_memory():
    cfg = get_config("debug_tiny")
    with torch.device("meta"):
        model = Llama(cfg)
    model.init_weights(seed=0, device="cpu")
    host = {n: p.detach() for n, p in model.named_parameters()}
    plan = sharding_plan(LLAMA)
    placed = plan.place(host, build_mesh(1, 8, 1))
    wq = placed["layers.0.attention.wq.weight"]
    assert wq.shape == (256, 256) and wq.sharding.spec == COLUMN
    np.testing.assert_array_equal(np.asarray(wq), host["layers.0.attention.wq.weight"].numpy())
    assert {s.data.shape for s in wq.addressable_shards} == {(32, 256)}
    bf16 = plan.place({"norm.weight": host["norm.weight"].to(torch.bfloat16)},
                      build_mesh(1, 8, 1))["norm.weight"]
    assert bf16.dtype == jax.numpy.bfloat16 and bf16.addressable_shards[0].data.shape == (32,)
    per_device = per_device_bytes(placed)
    total = sum(t.numel() * 4 for t in host.values())
    assert len(per_device) == 8
    assert all(b == total // 8 for b in per_device.values())


@pytest.mark.devices(8)
def test_clear_errors_for_uncovered_or_indivisible_parameters():
    plan = sharding_plan(LLAMA)
    # (LoRA adapters have a rule now: an adapter the plan does not know stands in.)
    with pytest.raises(PlanError, match="no rule matches parameter 'layers.0.prefix_tokens'"):
        plan.spec_for("layers.0.prefix_tokens")
    lenient = ShardingPlan([(r"wq", P("fsdp"))], default=P())
    assert lenient.spec_for("anything") == P()
    mesh = build_mesh(1, 8, 1)
    # Column-parallel: rows over fsdp if they divide, else the fallback (fsdp on columns)...
    assert plan.sharding_for("layers.0.attention.wq.weight", (16, 12), mesh).spec == COLUMN
    assert plan.sharding_for("layers.0.attention.wq.weight", (12, 16), mesh).spec == \
        P("tensor", "fsdp")
    # ... and the error, when neither divides, is the last alternative's.
    with pytest.raises(PlanError, match=r"dimension 1 \(size 12\) is split 8 ways"):
        plan.sharding_for("layers.0.attention.wq.weight", (12, 12), mesh)
    with pytest.raises(PlanError, match="has 2 entries but the parameter has shape"):
        plan.spec_for("output.weight", (16,))
    with pytest.raises(PlanError, match="which the mesh .* does not have"):
        ShardingPlan([(r".", P("model"))]).sharding_for("w", (8,), mesh)
    with pytest.raises(PlanError, match="bad regex"):
        ShardingPlan([("(", P())])


@pytest.mark.devices(8)
def test_state_shardings_follow_parameters():
    mesh = build_mesh(1, 4, 2)
    plan = sharding_plan(LLAMA)
    ps = plan.shardings({"output.weight": np.zeros((512, 256))}, mesh)
    state = {"output.weight": {"exp_avg": np.zeros((512, 256)), "step": np.zeros(())}}
    out = plan.state_shardings(ps, state)["output.weight"]
    assert out["exp_avg"] == ps["output.weight"]
    assert out["step"].spec == P()


@pytest.mark.devices(8)
def test_constrain_is_a_no_op_without_a_mesh_and_pins_with_one():
    x = jax.numpy.ones((8, 4))
    assert constrain(x, P("fsdp")) is x
    mesh = build_mesh(1, 8, 1)
    y = jax.jit(lambda a: constrain(a * 2, P(("data", "fsdp")), mesh))(x)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"))), 2)
    assert {s.data.shape for s in y.addressable_shards} == {(1, 4)}


def test_activation_rule_classifies_by_shape():
    cfg = get_config("debug_tiny")  # dim 256, heads 4/2, ffn 768, vocab 512
    rule = ActivationRule(LLAMA.split_sizes(cfg), batch=8, seq_len=64)
    u = P.UNCONSTRAINED
    assert rule((8, 64, 256)) == P(BATCH_AXES, u, u)
    assert rule((8, 4, 64, 64)) == P(BATCH_AXES, "tensor", u, u)
    assert rule((8 * 64, 768)) == P(BATCH_AXES, "tensor")
    assert rule((8, 64, 512)) == P(BATCH_AXES, u, "tensor")
    assert rule((256, 256)) is None and rule((8,)) is None


def test_activation_rule_splits_the_sequence_over_context():
    cfg = get_config("debug_tiny")
    rule = ActivationRule(LLAMA.split_sizes(cfg), batch=8, seq_len=64, context=2)
    u, b = P.UNCONSTRAINED, BATCH_AXES
    assert rule((8, 64, 256)) == P(b, "context", u)
    assert rule((8, 4, 64, 64)) == P(b, "tensor", "context", u)  # queries' rows, not keys
    assert rule((8, 64, 512)) == P(b, "context", "tensor")
    assert rule((8 * 64, 768)) is None  # [batch * seq]: no one spec of it splits both
    plan_rule = sharding_plan(LLAMA).activation_rule
    model = type("Model", (), {"config": cfg})()
    assert plan_rule(model, (8, 64), context=2)((8, 64, 256)) == P(b, "context", u)


@pytest.mark.devices(8)
def test_step_shardings_for_a_compiled_step():
    from tpu_train.parallel import step_shardings

    mesh = build_mesh(2, 2, 2)
    names = ["layers.0.attention.wq.weight", "norm.weight"]
    shapes = [(256, 256), (256,)]
    out = step_shardings(sharding_plan(LLAMA), mesh, param_names=names, param_shapes=shapes,
                         state_owners=[0, 0, 1, None], state_shapes=[(256, 256), (256, 256),
                                                                     (256,), ()],
                         num_consts=1, batch_shapes=[(8, 64), ()])
    assert out.params[0].spec == COLUMN
    assert out.states[:3] == (out.params[0], out.params[0], out.params[1])
    assert out.states[3].spec == P() and out.consts[0].spec == P()
    assert out.batch[0].shard_shape((8, 64)) == (2, 64)
    with pytest.raises(PlanError, match="does not split over data \\* fsdp \\* expert = 4 devices"):
        step_shardings(sharding_plan(LLAMA), mesh, param_names=[], param_shapes=[],
                       batch_shapes=[(6, 64)])
    with pytest.raises(PlanError, match="names parameter index 5"):
        step_shardings(sharding_plan(LLAMA), mesh, param_names=names, param_shapes=shapes,
                       state_owners=[5], state_shapes=[(1,)])


@pytest.mark.devices(8)
@pytest.mark.parametrize("spec, compute", [
    (P("tensor", "fsdp"), P("tensor", None)),       # column-parallel: gathered over fsdp
    (P("fsdp", "tensor"), P(None, "tensor")),       # row-parallel
    (P(("data", "fsdp")), P(None)),                 # batch axes only: whole
    (P(("tensor", "fsdp"), None), P("tensor", None)),
])
def test_compute_sharding_drops_only_the_batch_axes(spec, compute):
    from tpu_train.parallel import compute_sharding

    mesh = build_mesh(2, 2, 2)
    assert compute_sharding(NamedSharding(mesh, spec)).spec == compute


def test_weights_are_split_over_context_too_where_sequences_are(tiny_model):
    """With sequences split over context, each weight is stored over fsdp x context (a chip
    holds 1 / (fsdp x context) of it, as many ways as its tokens are split), gathered over
    both where it is used; where fsdp x context does not divide a dimension, the plan's own
    layout stands. With context=1 nothing changes (the first test)."""
    from tpu_train.compile.spmd import compute_sharding

    shardings = sharding_plan(LLAMA).shardings(tiny_model.named_parameters(),
                                               build_mesh(1, 2, 2, context=2))
    wq = shardings["layers.0.attention.wq.weight"]
    assert wq.spec == P(("tensor", "fsdp", "context"), None)
    assert shardings["layers.0.attention.wo.weight"].spec == P(("fsdp", "context"), "tensor")
    assert shardings["norm.weight"].spec == P(("fsdp", "context"))
    assert compute_sharding(wq).spec == P("tensor", None)
    odd = ShardingPlan([(r"w", P("fsdp"))]).sharding_for("w", (6,), build_mesh(1, 2, 1, context=4))
    assert odd.spec == P("fsdp")
