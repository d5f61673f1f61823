"""Building an int8 base (``model.base_dtype=int8``) a tensor at a time: the values are those
of quantizing the whole bfloat16 model, from a seeded initialization and from a Hugging Face
checkpoint, and the whole model is never alive in a float dtype on the host."""

from __future__ import annotations

import types
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.compile.test_out_of_memory import _config
from tpu_train.models.lora import LoRALinear, apply_lora
from tpu_train.trainer import builders, setup

LORA = ["recipe=llama_lora", "model=debug_tiny", "recipe.lora.rank=4"]


def _job(*overrides: str):
    return types.SimpleNamespace(cfg=_config(*LORA, *overrides))


def _adapt(cfg):
    lora = cfg.recipe.lora
    return lambda model: (apply_lora(model, list(lora.targets), lora.rank, lora.alpha), model)[1]


def _vocab(cfg):
    return types.SimpleNamespace(vocab_size=builders.model_config(cfg).vocab_size)


def _streamed(job):
    torch.manual_seed(0)  # the adapters' initialization
    return setup.build_model(job, _vocab(job.cfg), adapt=_adapt(job.cfg))


def _quantized_whole(job):
    """What the trainer built before: the whole model in bfloat16, adapted, then quantized."""
    torch.manual_seed(0)
    model = builders.build_model(job.cfg, _vocab(job.cfg).vocab_size, dtype=torch.bfloat16)
    return setup.store_frozen_base(job.cfg, _adapt(job.cfg)(model))


def _assert_same_base(got, expected):
    got, expected = got.state_dict(), expected.state_dict()
    assert sorted(got) == sorted(expected)
    base = [k for k in got if not k.endswith(("lora_a", "lora_b"))]
    for key in base:
        assert got[key].dtype == expected[key].dtype, key
        assert torch.equal(got[key], expected[key]), key
    assert any(got[k].dtype is torch.int8 for k in base)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_streamed_int8_base_is_the_quantized_bfloat16_model(precision):
    job = _job("model.base_dtype=int8", f"trainer.precision={precision}", "model.n_layers=3")
    streamed = _streamed(job)
    _assert_same_base(streamed, _quantized_whole(job))
    # The adapters are drawn as on a float base (in float32; no longer rounded to bfloat16).
    float_base = _streamed(_job(f"trainer.precision={precision}", "model.n_layers=3"))
    adapters = {k: v for k, v in streamed.state_dict().items() if k.endswith(("lora_a", "lora_b"))}
    assert adapters and all(torch.equal(v, float_base.state_dict()[k]) for k, v in adapters.items())
    assert all(v.dtype is torch.float32 for v in adapters.values())


def test_a_mixture_of_experts_streams_its_stacked_experts_in_float():
    job = _job("model.base_dtype=int8", "model=mixtral_tiny", "trainer.precision=bf16", "recipe.lora.targets=[wq,wv]")
    streamed = _streamed(job)
    _assert_same_base(streamed, _quantized_whole(job))
    # Not a linear: stored in the compute dtype, like the embeddings.
    assert streamed.layers[0].feed_forward.w1.dtype is streamed.tok_embeddings.weight.dtype


def test_a_streamed_int8_base_from_a_hugging_face_checkpoint_is_the_quantized_one(tmp_path):
    from tpu_train.models.llama import save_pretrained

    source = builders.build_model(_job("model.n_layers=2").cfg, 256, dtype=torch.bfloat16)
    with torch.no_grad():  # distinct norms, so that a norm left unread would show
        for name, param in source.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    save_pretrained(source, tmp_path)
    job = _job("model.base_dtype=int8", f"model.checkpoint={tmp_path}")
    streamed = _streamed(job)
    _assert_same_base(streamed, _quantized_whole(job))
    assert streamed.hf_special_tokens == {} and streamed.layers[1].attention_norm.weight.dtype \
        is torch.float32


def test_a_streamed_int8_base_from_a_training_checkpoint_is_the_quantized_one(tmp_path):
    from tpu_train.trainer.checkpoint import write_checkpoint

    source = builders.build_model(_config("trainer.seed=7", *LORA, "model.n_layers=2"), 256)
    state = {k: v for k, v in source.state_dict().items() if "layers.1." not in k}
    write_checkpoint(tmp_path, 3, state, {"step": 3})
    job = _job("model.base_dtype=int8", "model.n_layers=2",
               f"model.checkpoint={tmp_path / 'step_00000003'}")
    streamed = _streamed(job)
    _assert_same_base(streamed, _quantized_whole(job))
    # Its parameters replaced the seed's; those it lacks (layer 1) kept the seed's.
    seeded = _streamed(_job("model.base_dtype=int8", "model.n_layers=2"))
    assert not torch.equal(streamed.layers[0].attention.wq.weight,
                           seeded.layers[0].attention.wq.weight)
    assert torch.equal(streamed.layers[1].attention.wq.weight, seeded.layers[1].attention.wq.weight)


def test_a_checkpoint_missing_a_tensor_is_a_one_line_config_error(tmp_path):
    from safetensors.torch import load_file, save_file

    from tpu_train.models.llama import save_pretrained

    source = builders.build_model(_job("model.n_layers=2").cfg, 256, dtype=torch.bfloat16)
    save_pretrained(source, tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(setup.ConfigError, match="missing tensor 'model.layers.1.mlp.down_proj"):
        _streamed(_job("model.base_dtype=int8", f"model.checkpoint={tmp_path}"))


class _LiveFloatBytes(TorchDispatchMode):
    """The most bytes of CPU float storage alive at once among those made while it is on."""

    def __init__(self):
        super().__init__()
        self.alive: dict[int, int] = {}
        self.total = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"
                    and tensor.is_floating_point()):
                self._track(tensor.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key = id(storage)
        if key in self.alive:
            return
        self.alive[key] = storage.nbytes()
        self.total += storage.nbytes()
        self.peak = max(self.peak, self.total)
        weakref.finalize(storage, self._forget, key)

    def _forget(self, key: int) -> None:
        self.total -= self.alive.pop(key)


def test_the_int8_base_is_never_whole_in_a_float_dtype():
    """Float storage alive at once while an int8 base is built, beyond the finished model's
    own float tensors (embeddings, norms, scales, adapters): at most two layers' weights in
    float32 (one tensor being quantized and its temporaries). Built whole in bfloat16 first,
    a 12-layer model held six layers' worth of float32 beyond it."""
    job = _job("model.base_dtype=int8", "model.n_layers=12")
    with _LiveFloatBytes() as live:
        model = _streamed(job)
    finished = sum(p.untyped_storage().nbytes() for p in model.parameters()
                   if p.is_floating_point())
    layer = 4 * sum(p.numel() for p in model.layers[0].parameters())
    assert isinstance(model.layers[0].attention.wq, LoRALinear)
    assert model.layers[0].feed_forward.w1.weight.dtype is torch.int8
    assert live.peak - finished <= 2 * layer, (live.peak - finished) / layer
