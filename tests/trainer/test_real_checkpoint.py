"""Fine-tuning a Hugging Face checkpoint nobody here wrote: a `transformers` LlamaForCausalLM of a
size that is no named model option, with its own tokenizer (trained with `tokenizers`, saved by
`PreTrainedTokenizerFast`), through `tpu-train model.checkpoint=DIR data=jsonl ...`.

The architecture comes from the checkpoint's config.json, the tokenizer and its special tokens
from the checkpoint's tokenizer files, and the run's `hf/` export loads with transformers'
`AutoModelForCausalLM` and `AutoTokenizer`. (Damaged checkpoint directories are in
tests/bad_input/test_checkpoints.py.)
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch

from tests.tolerances import rtol_for
from tests.trainer.cli_helpers import TINY, one_thread, run_in_process  # noqa: F401
from tests.trainer.hf_checkpoint import (BOS, CHATML_TEMPLATE, EOS, HEADS, HIDDEN, INTERMEDIATE,
                                         KV_HEADS, LAYERS, LLAMA3_TEMPLATE, PAD, LINES,
                                         custom_llama)  # noqa: F401 (a fixture)

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def checkpoint(custom_llama) -> Path:
    return custom_llama


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    records = [{"prompt": f"{line} ", "response": line[::-1]} for line in LINES] * 3
    # Chat records: rendered with the checkpoint's own chat template (it has no Llama 3 tokens).
    records += [{"messages": [{"role": "user", "content": line},
                              {"role": "assistant", "content": line[::-1]}]} for line in LINES]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _run(checkpoint_dir: Path, train_file: Path, run_dir: Path, *extra: str):
    return run_in_process(f"model.checkpoint={checkpoint_dir}", "data=jsonl",
                          f"data.path={train_file}", *TINY, "trainer.max_steps=3",
                          f"run.dir={run_dir}", *extra)


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).norm() / reference.norm())


def test_finetunes_a_non_preset_checkpoint_with_its_tokenizer(checkpoint, train_file, tmp_path,
                                                              one_thread):
    from tpu_train.data import load_tokenizer
    from tpu_train.models import from_pretrained

    run_dir = tmp_path / "run"
    code, out, err = _run(checkpoint, train_file, run_dir, "checkpoint.export_hf=true")
    assert code == 0, err
    assert "step 3/3" in out
    export = run_dir / "hf"

    # The checkpoint's architecture (no model= option names it) ...
    config = json.loads((export / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == (
        HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE)
    assert config["rope_theta"] == 20000.0 and config["rms_norm_eps"] == 1e-6
    # ... and its tokenizer: the bundled one has 512 tokens, more than this model's rows, and
    # knows none of these special tokens.
    source = transformers.AutoTokenizer.from_pretrained(checkpoint)
    assert config["vocab_size"] == len(source) < 512
    ours = load_tokenizer(checkpoint)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (
        source.bos_token_id, source.eos_token_id, source.pad_token_id)
    assert (config["bos_token_id"], config["eos_token_id"]) == (ours.bos_id, ours.eos_id)
    assert ((export / "tokenizer.json").read_bytes()
            == (checkpoint / "tokenizer.json").read_bytes())

    # The export loads everywhere, world-readable.
    for path in export.iterdir():
        assert path.stat().st_mode & stat.S_IROTH, path
    generation = json.loads((export / "generation_config.json").read_text())
    assert generation["eos_token_id"] == ours.eos_id
    exported_tok = transformers.AutoTokenizer.from_pretrained(export)
    text = "Reverse the letters of the word."
    assert exported_tok(text, add_special_tokens=False).input_ids == ours.encode(text)
    assert (exported_tok.bos_token, exported_tok.eos_token, exported_tok.pad_token) == (BOS, EOS, PAD)
    assert exported_tok.chat_template == CHATML_TEMPLATE
    reference = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    reference.eval()

    # Trained (the weights moved), and our model's logits equal transformers' on the export.
    original = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    assert not torch.equal(original.lm_head.weight, reference.lm_head.weight)
    model = from_pretrained(export, dtype=torch.float32, device="cpu").eval()
    ids = torch.tensor([[ours.bos_id] + ours.encode(text)])
    with torch.no_grad():
        expected = reference(ids).logits
        got = model(ids)
    rtol = rtol_for(torch.float32, reduction=INTERMEDIATE, depth=LAYERS)
    assert _relative_error(got, expected) <= rtol


def _template_ids(fast, messages, add_generation_prompt: bool) -> list[int]:
    ids = fast.apply_chat_template(messages, tokenize=True,
                                   add_generation_prompt=add_generation_prompt)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, LLAMA3_TEMPLATE], ids=["chatml", "llama3"])
def test_chat_template_matches_transformers(template, checkpoint, tmp_path):
    """format_chat renders with the tokenizer's own chat_template token for token as
    transformers' apply_chat_template does, and only assistant turns are targets."""
    from tpu_train.data import format_chat, load_tokenizer

    fast = transformers.AutoTokenizer.from_pretrained(checkpoint)
    fast.chat_template = template
    fast.save_pretrained(tmp_path / "tok")
    ours = load_tokenizer(tmp_path / "tok")
    assert ours.chat_template == template
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Reverse the word cat."},
        {"role": "assistant", "content": "tac"},
        {"role": "user", "content": "Add 12 and 30, with <|im_end|> typed literally."},
        {"role": "assistant", "content": "The sum is 42."},
    ]
    chat = format_chat(ours, messages)
    assert chat.ids == _template_ids(fast, messages, False)
    prompt = format_chat(ours, messages[:4], add_generation_prompt=True)
    assert prompt.ids == _template_ids(fast, messages[:4], True)
    targets = ours.decode([i for i, t in zip(chat.ids, chat.target_mask) if t])
    assert "tac" in targets and "The sum is 42." in targets
    assert "Reverse" not in targets and "Answer" not in targets and "Add 12" not in targets
