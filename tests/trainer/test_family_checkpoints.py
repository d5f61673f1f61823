"""Fine-tuning Qwen2 and Mistral checkpoints written by `transformers` (tiny, with their own
tokenizer) through `tpu-train recipe=llama_finetune model.checkpoint=DIR`: the run takes the
family from config.json, trains, and its `hf/` export reloads in transformers as the same
architecture with our logits. Mistral's 8-token window is shorter than the 32-token rows, so
training sees it cut, eagerly on the CPU and in the compiled step on the tpu device; Qwen2's
biases train under tensor parallelism too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.tolerances import rtol_for
from tests.trainer.cli_helpers import TINY, TINY_COMPILED, one_thread, run_in_process  # noqa: F401
from tests.trainer.hf_checkpoint import INTERMEDIATE, LAYERS, LINES, save_custom_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

CLASSES = {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {family: save_custom_llama(root / family, family) for family in CLASSES}


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    records = [{"prompt": f"{line} ", "response": line[::-1]} for line in LINES] * 3
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# Eager on the CPU; compiled on the tpu device over 8 virtual devices, Qwen2's biases split
# with their weights' heads over parallel.tensor=2.
MODES = {"eager": TINY, "compiled": TINY_COMPILED,
         "compiled_tensor_parallel": [*TINY_COMPILED, "parallel.tensor=2"]}


@pytest.mark.parametrize("family,mode", [("qwen2", "eager"), ("mistral", "eager"),
                                         ("mistral", "compiled"),
                                         ("qwen2", "compiled_tensor_parallel")])
def test_finetunes_and_exports_a_family_checkpoint(family, mode, checkpoints, train_file,
                                                   tmp_path, one_thread):
    from tpu_train.data import load_tokenizer
    from tpu_train.models import from_pretrained

    checkpoint = checkpoints[family]
    run_dir = tmp_path / "run"
    code, out, err = run_in_process(
        "recipe=llama_finetune", f"model.checkpoint={checkpoint}", "data=jsonl",
        f"data.path={train_file}", *MODES[mode],
        "trainer.max_steps=3", "checkpoint.export_hf=true", f"run.dir={run_dir}")
    assert code == 0, err
    assert "step 3/3" in out
    if mode == "compiled_tensor_parallel":
        assert "mesh data=4 fsdp=1 tensor=2" in out
    export = run_dir / "hf"
    source_config = json.loads((checkpoint / "config.json").read_text())
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == family and config["architectures"] == [CLASSES[family]]
    for key in ("rope_theta", "rms_norm_eps", "tie_word_embeddings", "sliding_window"):
        expected = source_config.get(key, source_config.get("rope_parameters", {}).get(key))
        assert config.get(key) == expected, key

    reference = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert type(reference).__name__ == CLASSES[family]
    original = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    trained = reference.model.layers[0].self_attn.q_proj
    assert not torch.equal(original.model.layers[0].self_attn.q_proj.weight, trained.weight)
    if family == "qwen2":  # the biases were loaded, trained and exported
        assert not torch.equal(original.model.layers[0].self_attn.q_proj.bias, trained.bias)

    tokenizer = load_tokenizer(checkpoint)
    text = " ".join(LINES[:2])  # longer than Mistral's window
    ids = torch.tensor([[tokenizer.bos_id] + tokenizer.encode(text)])
    assert ids.shape[1] > 16
    model = from_pretrained(export, dtype=torch.float32, device="cpu").eval()
    with torch.no_grad():
        expected = reference.eval()(ids).logits
        got = model(ids)
    rtol = rtol_for(torch.float32, reduction=INTERMEDIATE, depth=LAYERS)
    assert float((got - expected).norm() / expected.norm()) <= rtol
