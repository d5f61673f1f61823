"""Data pipeline: tokenizers, datasets, packing, a synthetic task and device prefetching.

Pure PyTorch/Python; nothing here touches JAX or a device other than through ``Tensor.to``.

Tokenizers
    ``load_tokenizer(path=None)`` loads a Hugging Face ``tokenizer.json`` or a SentencePiece
    ``tokenizer.model`` (a file, or a directory holding one; ``None`` = the bundled 512-token
    byte-level BPE). Every ``Tokenizer`` has ``encode(text, bos, eos)``, ``encode_batch``,
    ``decode(ids)``, ``vocab_size``, ``bos_id``, ``eos_id``, ``pad_id`` and ``special_ids``.
    ``format_chat(tokenizer, messages, add_generation_prompt=False)`` renders the Llama 3 chat
    format and returns ``FormattedChat(ids, target_mask)`` (assistant content + ``<|eot_id|>``).

Training batches
    ``PackedLoader(paths, tokenizer, seq_len, batch_size, format="auto", mask_prompt=True,
    shuffle_buffer=0, seed=0, num_epochs=None, weights=None, column_map=None)`` streams text /
    instruction / chat records from JSONL, ``.txt``, JSON, Parquet files or ``save_to_disk``
    directories (``sources.py``; ``weights``: a seeded mixture of the files, ``streams.py``),
    packs samples (``<bos> ... <eos>``) into rows and yields
    ``{"tokens": [B, S], "labels": [B, S]}`` int64 CPU tensors; ``labels[:, i]`` is the target
    of ``tokens[:, i]`` (already shifted), ``-100`` = ignored. ``state_dict()`` /
    ``load_state_dict()`` resume exactly.

Random token ids
    ``RandomTokenLoader(vocab_size, seq_len, batch_size, seed=0)`` yields endless batches of
    uniformly random ids in the same form, seeded per batch, resumable: for measuring
    throughput without a dataset (``tpu-train data=synthetic_tokens``).

Evaluation batches
    ``PaddedInstructionLoader(path, tokenizer, batch_size)`` yields whole, padded
    instruction/chat samples with ``prompt_tokens`` (left-padded), ``prompts`` and ``references``.

Prefetching
    ``WorkerPrefetcher(loader, depth=2)`` builds a ``PackedLoader``'s next batches in a worker
    process (the trainer's ``data.prefetch``); ``Prefetcher(batches, depth=2)`` on a thread;
    ``DevicePrefetcher(batches, device, depth=2)`` also moves them to the device. All are
    resumable through the source's state (that of the last batch consumed), closable, context
    managers.

Synthetic task and bundled corpus
    ``generate_examples(n, split, seed)``, ``write_jsonl``, ``extract_response``,
    ``exact_match``; ``default_corpus_dir()`` (``pretrain.jsonl``, ``tasks_train.jsonl``,
    ``tasks_heldout.jsonl``) and ``default_tokenizer_path()``.

Errors
    Bad data raises ``DataError`` (a ``ValueError``) naming the file and, for a bad record, the
    line number.
"""

import importlib

# Names load on first use (as in tpu_train.models): the command line checks data settings
# (the templates' names, the sources' kinds) before it imports torch, which packing needs.
_SOURCES = {
    "DataError": "errors",
    "DevicePrefetcher": "prefetch",
    "Example": "datasets",
    "FormattedChat": "chat",
    "HFTokenizer": "tokenizer",
    "IGNORE_INDEX": "packing",
    "PackedLoader": "packing",
    "PaddedInstructionLoader": "padded",
    "Prefetcher": "prefetch",
    "RandomTokenLoader": "random_tokens",
    "Sample": "datasets",
    "SentencePieceTokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "WorkerPrefetcher": "worker",
    "default_corpus_dir": "corpus",
    "default_tokenizer_path": "tokenizer",
    "encode_examples": "datasets",
    "exact_match": "synthetic",
    "extract_response": "synthetic",
    "format_chat": "chat",
    "generate_examples": "synthetic",
    "iter_examples": "synthetic",
    "load_tokenizer": "tokenizer",
    "move_batch": "prefetch",
    "read_records": "datasets",
    "write_jsonl": "synthetic",
}

__all__ = [
    "DataError",
    "DevicePrefetcher",
    "Example",
    "FormattedChat",
    "HFTokenizer",
    "IGNORE_INDEX",
    "PackedLoader",
    "Prefetcher",
    "PaddedInstructionLoader",
    "RandomTokenLoader",
    "Sample",
    "SentencePieceTokenizer",
    "Tokenizer",
    "WorkerPrefetcher",
    "default_corpus_dir",
    "default_tokenizer_path",
    "encode_examples",
    "exact_match",
    "extract_response",
    "format_chat",
    "generate_examples",
    "iter_examples",
    "load_tokenizer",
    "move_batch",
    "read_records",
    "write_jsonl",
]


def __getattr__(name: str):
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
