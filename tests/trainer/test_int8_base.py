"""LoRA on an int8 base (``model.base_dtype=int8``): the quantization's error bounds, the
compiled step's int8 storage, training, and checkpoints of the adapters only."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.trainer.cli_helpers import TINY, read_metrics, run_in_process
from tpu_train.models import Llama, LlamaConfig
from tpu_train.models.lora import (INT8_MAX, Int8Linear, LoRALinear, apply_lora, merge_lora,
                                   quantize_frozen_linears, quantize_rows, store_frozen_floats)

CONFIG = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128,
                     ffn_hidden_dim=192, max_seq_len=32)
TARGETS = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]


def _model(seed: int = 0) -> Llama:
    with torch.device("meta"):
        model = Llama(CONFIG)
    return model.init_weights(seed=seed, device="cpu")


def _int8_lora(model: Llama) -> Llama:
    apply_lora(model, TARGETS, rank=4, alpha=8.0)
    quantize_frozen_linears(model)
    return model


def test_rows_round_to_the_nearest_step_of_their_own_scale():
    weight = torch.randn(48, 80, generator=torch.Generator().manual_seed(0))
    weight[3] = 0.0
    weight[5] *= 100.0  # a row with a larger range keeps its own, coarser step
    q, scale = quantize_rows(weight)
    assert q.dtype is torch.int8 and scale.dtype is torch.float32 and scale.shape == (48,)
    torch.testing.assert_close(scale[5], weight[5].abs().max() / INT8_MAX)
    # Each row's own absmax maps to 127 (one scale per row, not one per tensor).
    peaks = q.abs().amax(dim=1)
    assert int(peaks[3]) == 0 and bool((peaks[torch.arange(48) != 3] == INT8_MAX).all())
    error = (q.float() * scale[:, None] - weight).abs()
    # Half a step per value (plus float32 rounding of w / s); row 3 stays exactly zero.
    assert bool((error <= scale[:, None] * (0.5 + 1e-6)).all())
    assert float(error[3].max()) == 0.0


def test_an_int8_linear_is_off_by_at_most_half_a_step_times_the_inputs_l1_norm():
    """Each output ``y_i = sum_j x_j w_ij`` changes by ``sum_j x_j e_ij`` with ``|e_ij| <=
    s_i / 2``: at most ``||x||_1 s_i / 2``, a bound the layer must meet exactly."""
    generator = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=generator))
    x = torch.randn(7, 96, generator=generator)
    quantized = Int8Linear(linear)
    bound = x.abs().sum(-1, keepdim=True) * quantized.weight_scale / 2
    error = (quantized(x) - linear(x)).detach().abs()
    assert bool((error <= bound * (1 + 1e-5)).all())
    assert float(error.max()) > 0  # quantized, not passed through
    torch.testing.assert_close(quantized.dequantized()(x), quantized(x))


def _first_order_sigma(model: Llama, tokens: torch.Tensor, position: int, vocab_id: int,
                       scales: dict[str, torch.Tensor]) -> float:
    """The standard deviation of one logit's first-order error when each weight ``w_ij`` of
    a quantized matrix is off by an independent rounding error, uniform in ``[-s_i/2, s_i/2]``
    (variance ``s_i^2 / 12``): ``sqrt(sum_ij (d logit / d w_ij)^2 s_i^2 / 12)``."""
    params = dict(model.named_parameters())
    weights = [params[name] for name in scales]
    for w in weights:
        w.requires_grad_(True)
    logit = model(tokens)[0, position, vocab_id]
    grads = torch.autograd.grad(logit, weights)
    for w in weights:
        w.requires_grad_(False)
    variance = sum(float(((g * s[:, None]) ** 2).sum()) / 12 for g, s in zip(grads, scales.values()))
    return math.sqrt(variance)


def test_int8_base_logits_are_within_six_sigma_of_the_float_models():
    """The bound is derived from the quantization step alone: each logit's error, to first
    order, is a sum of independent rounding errors (one per quantized weight, uniform within
    half its row's step), whose standard deviation is ``sigma`` above; every checked logit
    must lie within ``6 sigma`` of the float32 model's (a Gaussian exceeds that with
    probability 2e-9). Rounding down instead of to the nearest value adds a bias that took
    a checked logit past it (6.5 sigma)."""
    reference = _model()
    apply_lora(reference, TARGETS, rank=4, alpha=8.0)  # B = 0: the base model's logits
    quantized = _model()
    _int8_lora(quantized)
    names = [n for n, m in quantized.named_modules()
             if isinstance(m, (Int8Linear, LoRALinear))]
    assert len(names) == 7 * CONFIG.n_layers + 1  # every projection and the output head
    modules = dict(quantized.named_modules())
    scales = {f"{n}.weight": modules[n].weight_scale for n in names}
    tokens = torch.randint(0, CONFIG.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got = reference(tokens), quantized(tokens)
    checked = [(p, v) for p in (0, 7, 15) for v in (0, 31, 64, 127)]
    errors = []
    for position, vocab_id in checked:
        sigma = _first_order_sigma(reference, tokens, position, vocab_id, scales)
        error = float((got - expected)[0, position, vocab_id].abs())
        errors.append(error / sigma)
        assert error <= 6 * sigma, (position, vocab_id, error, sigma)
    # And sigma is the errors' scale, not a loose bound: their RMS in sigmas is of order one
    # (1.0 when measured; a quantization off by a constant factor moves it away).
    rms = math.sqrt(sum(r * r for r in errors) / len(errors))
    assert 0.3 < rms < 3, errors


def _lowered_step(model: Llama):
    from tpu_train.compile import lower_train_step

    with torch.device("meta"):
        tokens = torch.empty(2, 16, dtype=torch.int64)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def loss_fn(m, batch):
        logits = m(batch["tokens"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    program = lower_train_step(model, optimizer, loss_fn, {"tokens": tokens, "labels": tokens},
                               compute_dtype=torch.bfloat16, runtime_options=False,
                               compile=False)
    return program, optimizer


def test_the_compiled_step_keeps_int8_weights_and_trains_the_adapters_only():
    import re

    with torch.device("meta"):
        model = Llama(CONFIG)
    _int8_lora(model)
    store_frozen_floats(model, torch.bfloat16)  # as trainer.precision=bf16 stores them
    program, optimizer = _lowered_step(model)
    text = program.lowered.as_text()
    main = text[text.index("func.func public @main"):]
    signature = main[:main.index("\n")]
    int8_args = re.findall(r"tensor<(\d+)x(\d+)xi8>", signature)
    quantized = [m for m in model.modules() if isinstance(m, (Int8Linear, LoRALinear))]
    assert sorted(int8_args) == sorted((str(m.out_features), str(m.in_features))
                                       for m in quantized)
    for m in quantized:  # each weight with its float32 scale beside it
        assert f"tensor<{m.out_features}xf32>" in signature
    # The int8 values are converted for the matmul, whose operands are all bfloat16.
    assert re.search(r"stablehlo\.convert .*: \(tensor<\d+x\d+xi8>\) -> tensor<\d+x\d+xbf16>",
                     text)
    dots = re.findall(r"stablehlo\.dot_general .*: \((tensor<[^)]*)\) ->", text)
    assert dots and all(operands.count("bf16>") == 2 for operands in dots), dots[:3]
    trained = {name for name, p in model.named_parameters() if p in optimizer.state}
    assert trained and all(name.endswith(("lora_a", "lora_b")) for name in trained)


def test_lora_training_loss_falls_with_an_int8_base():
    import tpu_train
    from tpu_train.compile import compile_train_step

    device = tpu_train.device(0)
    torch.manual_seed(0)
    model = _int8_lora(_model())
    store_frozen_floats(model, torch.bfloat16)
    model = model.to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 32), generator=torch.Generator().manual_seed(3))
    batch = {"tokens": tokens.to(device), "labels": tokens.roll(-1, 1).to(device)}

    def loss_fn(m, b):
        logits = m(b["tokens"])
        return F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten())

    step = compile_train_step(model, optimizer, loss_fn, compute_dtype=torch.bfloat16)
    losses = [float(step(batch)["loss"]) for _ in range(16)]
    # One fixed batch: the adapters fit it (the loss of 12 steps went 4.84 -> 4.31).
    assert losses[-1] < 0.92 * losses[0], losses
    assert model.layers[0].attention.wq.weight.dtype is torch.int8


def test_merged_export_of_an_int8_base_is_a_plain_float_model():
    model = _int8_lora(_model())
    with torch.no_grad():
        model.layers[0].attention.wq.lora_b.normal_()
    tokens = torch.randint(0, CONFIG.vocab_size, (1, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(tokens)
        merge_lora(model)
        after = model(tokens)
    assert all(p.dtype is torch.float32 for p in model.parameters())
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_an_int8_base_run_resumes_exactly_from_adapters_only_checkpoints(tmp_path):
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    common = ["recipe=llama_lora", "model.base_dtype=int8", *TINY, "trainer.max_steps=4",
              "checkpoint.every_n_steps=2", "checkpoint.async_save=false", f"run.dir={run_dir}"]
    code, _, err = run_in_process(*common)
    assert code == 0, err
    saved = load_file(str(run_dir / "checkpoints" / "step_00000002" / "model.safetensors"))
    assert saved and all(key.endswith(("lora_a", "lora_b")) for key in saved), sorted(saved)[:4]
    first = {step: r["train/loss"] for step, r in read_metrics(run_dir).items()}
    assert sorted(first) == [1, 2, 3, 4]
    code, out, err = run_in_process(*common, "checkpoint.load_step=2")
    assert code == 0, err
    assert "(resumed from step_00000002)" in out
    assert {step: r["train/loss"] for step, r in read_metrics(run_dir).items()} == first
    # Generating from such a checkpoint needs the base: the error names the merged export.
    code, _, err = run_in_process("recipe=generate", f"run.dir={run_dir}",
                                  "recipe.generate.max_new_tokens=2")
    assert code != 0 and "holds LoRA adapters only" in err and f"{run_dir}/hf" in err, err


@pytest.mark.parametrize("overrides, world_size, message", [
    (["recipe=llama_finetune"], "1", "model.base_dtype=int8 stores frozen weights in int8, "
                                     "but recipe=llama_finetune trains every linear weight"),
    (["recipe=llama_lora", "trainer.mode=eager"], "2",
     "model.base_dtype=int8 with trainer.mode=eager under a launcher"),
])
def test_settings_an_int8_base_cannot_work_with_are_one_line_errors(tmp_path, monkeypatch,
                                                                      overrides, world_size,
                                                                      message):
    monkeypatch.setenv("WORLD_SIZE", world_size)
    run_dir = tmp_path / "run"
    code, _, err = run_in_process(*overrides, "model.base_dtype=int8", *TINY,
                                  "trainer.max_steps=1", f"run.dir={run_dir}")
    assert code != 0 and message in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not run_dir.exists()


def test_an_int8_base_trains_the_same_with_each_layer_rematerialized():
    """``trainer.remat=full`` on an int8 base: the layers' frozen int8 weights are inputs of
    the recomputed regions like their float ones (captured, they failed to trace), and
    recomputation changes no loss."""
    import tpu_train
    from tpu_train.compile import compile_train_step
    from tpu_train.parallel.activation_checkpointing import apply_activation_checkpointing

    tokens = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))

    def losses(remat: bool) -> list[float]:
        device = tpu_train.device(0)
        torch.manual_seed(0)  # the adapters' initialization
        model = _int8_lora(_model())
        if remat:
            apply_activation_checkpointing(model, "full")
        model = model.to(device)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        batch = {"tokens": tokens.to(device), "labels": tokens.roll(-1, 1).to(device)}

        def loss_fn(m, b):
            return F.cross_entropy(m(b["tokens"]).flatten(0, 1), b["labels"].flatten())

        step = compile_train_step(model, optimizer, loss_fn)
        return [float(step(batch)["loss"]) for _ in range(3)]

    plain, rematerialized = losses(False), losses(True)
    assert rematerialized[-1] < rematerialized[0]
    torch.testing.assert_close(rematerialized, plain, rtol=1e-5, atol=1e-5)
