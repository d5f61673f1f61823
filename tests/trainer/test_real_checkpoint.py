"""Fine-tuning a Hugging Face checkpoint nobody here wrote: a `transformers` LlamaForCausalLM of a
size that is no named model option, with its own tokenizer (trained with `tokenizers`, saved by
`PreTrainedTokenizerFast`), through `tpu-train model.checkpoint=DIR data=jsonl ...`.

The architecture comes from the checkpoint's config.json, the tokenizer and its special tokens
from the checkpoint's tokenizer files, and the run's `hf/` export loads with transformers'
`AutoModelForCausalLM` and `AutoTokenizer`. Bad checkpoint directories are one-line errors
(exit 2) that write nothing.
"""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest
import torch

from tests.tolerances import rtol_for
from tests.trainer.cli_helpers import TINY, one_thread, run_in_process, snapshot  # noqa: F401

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# Special tokens no built-in heuristic knows: the run can only find them through the
# checkpoint's tokenizer_config.json / special_tokens_map.json.
BOS, EOS, PAD = "<|start|>", "<|stop|>", "<|fill|>"
CHAT_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eot_id|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}")
# Not one of the named model options (debug_tiny is 256 wide, 4 layers, 4 heads).
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 96, 3, 6, 2, 200

_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "Add the two numbers and write the sum.",
    "Reverse the letters of the word and answer with it.",
    "A checkpoint holds the weights; a tokenizer turns text into ids.",
    "Rivers run to the sea, and the sea is never full.",
    "Count the vowels in the sentence and reply with a number.",
]


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[BOS, EOS, PAD, *CHAT_SPECIALS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_LINES * 4, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A transformers Llama of a non-preset size with its own tokenizer, saved in one dir."""
    directory = tmp_path_factory.mktemp("ckpt") / "custom-llama"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=_train_tokenizer(),
                                                bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(directory)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=len(fast),
        max_position_embeddings=64, rope_theta=20000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    records = [{"prompt": f"{line} ", "response": line[::-1]} for line in _LINES] * 3
    # Chat records: rendered with the checkpoint's own chat template (it has no Llama 3 tokens).
    records += [{"messages": [{"role": "user", "content": line},
                              {"role": "assistant", "content": line[::-1]}]} for line in _LINES]
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


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data))


def _no_config(d: Path) -> None:
    (d / "config.json").unlink()


def _bad_json(d: Path) -> None:
    (d / "config.json").write_text('{"model_type": "llama", ')


def _other_architecture(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    _write_json(d / "config.json", config)


def _no_tokenizer(d: Path) -> None:
    (d / "tokenizer.json").unlink()


def _unknown_special_token(d: Path) -> None:
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|not-in-vocab|>"
    _write_json(d / "tokenizer_config.json", config)


@pytest.mark.parametrize("damage, extra, expected", [
    (_no_config, (), "config.json not found"),
    (_bad_json, (), "config.json: not readable JSON"),
    (_other_architecture, (), "architectures=['GPT2LMHeadModel']"),
    (_no_tokenizer, (), "holds no tokenizer (tokenizer.json or tokenizer.model)"),
    (_unknown_special_token, (), "names eos token '<|not-in-vocab|>'"),
    # The bundled 512-token tokenizer with a smaller model: ids beyond its embedding rows.
    (None, ("data.tokenizer=BUNDLED",), "ids >= "),
], ids=["no_config", "bad_json", "other_architecture", "no_tokenizer", "unknown_special_token",
        "vocabulary_mismatch"])
def test_bad_checkpoint_is_a_one_line_error(damage, extra, expected, checkpoint, train_file,
                                            tmp_path):
    from tpu_train.data import default_tokenizer_path

    bad = tmp_path / "ckpt"
    shutil.copytree(checkpoint, bad)
    if damage is not None:
        damage(bad)
    extra = [e.replace("BUNDLED", str(default_tokenizer_path())) for e in extra]
    before = snapshot(tmp_path)
    code, out, err = _run(bad, train_file, tmp_path / "run", *extra)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpu-train: error: "), err
    assert expected in lines[0], lines[0]
    assert "Traceback" not in err
    assert snapshot(tmp_path) == before
