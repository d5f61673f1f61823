"""Validation loss, perplexity and exact match of generated answers."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from .config import Precision
from .step import IGNORE_INDEX, autocast_context, causal_lm_loss_sum

# Prompts per compiled decoding call of exact match (the batch bucket). XLA's TPU compiler
# takes time in proportion to the rows one program holds: the default job's decoding program
# (prompt bucket 128, 16 new tokens) compiled for a v5e in 180 s on a busy 2-core host at 32
# rows, 134 s at 16, 58 s at 8, 50 s at 4; on the chip, 32 rows took 10.7 s. The CPU client
# decodes the 200 prompts in the same time either way (within its noise).
DECODE_BATCH = 8

if TYPE_CHECKING:  # imported when used: an eager CPU run never loads the compile layer
    from tpu_train.compile.decoding import CompiledDecoder


def runs_on_host_cpu(device: torch.device) -> bool:
    """True when ``device`` is a ``tpu`` device backed by the CPU PJRT client.

    The validation loss then runs on a host copy of the model: it is op by op, and op-by-op
    dispatch through the CPU client took 17 s for 20 greedy answers of the default run's model
    where PyTorch's own CPU kernels, on the same cores, took 1 to 2 s. Decoding on a ``tpu``
    device is compiled instead (:func:`compiled_decoder`).
    """
    if device.type != "tpu":
        return False
    from tpu_train.device.runtime import platform

    return platform() == "cpu"


def evaluation_device(device: torch.device) -> torch.device:
    """Where to evaluate or sample a model meant for ``device``: the CPU instead of a ``tpu``
    device backed by the CPU client (see :func:`runs_on_host_cpu`), else ``device`` itself."""
    return torch.device("cpu") if runs_on_host_cpu(device) else device


def decodes_compiled(device: torch.device) -> bool:
    """Does decoding on ``device`` use a :func:`compiled_decoder` (every ``tpu`` device)
    rather than eager PyTorch (the CPU)?"""
    return device.type == "tpu"


def compiled_decoder(model: torch.nn.Module, precision: Precision) -> CompiledDecoder:
    """A compiled decoder of the model on its ``tpu`` device, computing in ``precision``
    (``trainer.precision``: bf16 runs the model under bf16 autocast, as validation does); keep
    it to reuse its programs (they take the weights as inputs, so they serve every later state
    of the model)."""
    from tpu_train.compile.decoding import CompiledDecoder
    from tpu_train.models.generation import StaticCacheDecoding

    return CompiledDecoder(model, StaticCacheDecoding(), autocast_dtype=precision.compute_dtype)


@dataclasses.dataclass
class Decoding:
    """How exact match decodes answers: on ``device`` in ``precision``, at most
    ``max_new_tokens`` each, with ``decoder`` (a :func:`compiled_decoder` of the model) or,
    without one, op by op."""

    device: torch.device
    precision: Precision
    max_new_tokens: int
    decoder: CompiledDecoder | None = None


@dataclasses.dataclass
class ExactMatchSet:
    """The examples exact match scores: the first ``max_examples`` of the instruction/chat file
    at ``path``, tokenized by ``tokenizer``."""

    tokenizer: object
    path: Path | None
    max_examples: int


def describe_decoder(decoder: CompiledDecoder) -> str:
    """``decoding: compiled on tpu:0, 1 program (trace + lower + compile 2.31s)``."""
    records = decoder.compilations
    seconds = sum(r.total_s for r in records)
    return (f"decoding: compiled on {decoder.model.tok_embeddings.weight.device}, "
            f"{len(records)} program{'s' if len(records) != 1 else ''} "
            f"(trace + lower + compile {seconds:.2f}s)")


class HostEvaluationModel:
    """A CPU model of the same architecture whose weights are refreshed from the trained one.

    ``make_model`` builds the (randomly initialized) CPU model once; :meth:`refresh` copies the
    trained model's current state (whole CPU tensors) into it before each evaluation.
    """

    def __init__(self, make_model):
        self._make_model = make_model
        self._model: torch.nn.Module | None = None

    def refresh(self, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        if self._model is None:
            self._model = self._make_model()
        self._model.load_state_dict(state)
        return self._model


@torch.no_grad()
def validation_loss(model: torch.nn.Module, loader, device: torch.device, max_batches: int,
                    precision: Precision) -> dict[str, float]:
    """Token-weighted mean loss over at most ``max_batches`` batches, and its perplexity."""
    def loss_sum(batch: dict[str, torch.Tensor]) -> float:
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast_context(device, precision):
            return float(causal_lm_loss_sum(model, batch))

    return _mean_loss(model, loader, max_batches, loss_sum)


def compiled_loss(model: torch.nn.Module, precision: Precision,
                  rows_per_piece: int | None = None):
    """The summed next-token loss of the model on its ``tpu`` device as one compiled program
    per batch shape, computing in ``precision`` (as :func:`compiled_decoder`), over pieces of
    ``rows_per_piece`` rows at a time (``trainer.micro_batch_size``: the same reason, compile
    time on a TPU); keep it to reuse its programs."""
    from tpu_train.compile.evaluation import CompiledLoss

    return CompiledLoss(model, causal_lm_loss_sum, autocast_dtype=precision.compute_dtype,
                        name="validation loss", rows_per_piece=rows_per_piece)


def compiled_validation_loss(evaluator, loader, max_batches: int) -> dict[str, float]:
    """:func:`validation_loss` by ``evaluator``, a :func:`compiled_loss` of the model. Each
    batch is padded to the loader's ``batch_size`` rows (:func:`padded_rows`), so that the
    pass's short last batch runs the program of the full ones instead of compiling its own
    (on a chip, seconds of the first validation)."""
    rows = loader.batch_size
    return _mean_loss(evaluator.model, loader, max_batches,
                      lambda batch: evaluator(padded_rows(batch, rows)))


def padded_rows(batch: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """``batch`` with rows appended up to ``rows``: token 0, every label ignored, so that they
    add nothing to a summed loss (rows attend only within themselves)."""
    missing = rows - batch["tokens"].shape[0]
    if missing <= 0:
        return batch
    return {key: torch.cat([value, value.new_full((missing, *value.shape[1:]),
                                                  IGNORE_INDEX if key == "labels" else 0)])
            for key, value in batch.items()}


def _mean_loss(model: torch.nn.Module, loader, max_batches: int,
               loss_sum: Callable[[dict], float]) -> dict[str, float]:
    model.eval()
    total, tokens = 0.0, 0
    try:
        for index, batch in enumerate(loader):
            if index >= max_batches:
                break
            total += loss_sum(batch)
            tokens += int((batch["labels"] != IGNORE_INDEX).sum())
    finally:
        model.train()
    if tokens == 0:
        return {}
    loss = total / tokens
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def _exact_match_examples(path: Path, tokenizer, max_examples: int, limit: int):
    """(prompt token ids, at most the last ``limit``; reference) of the first examples."""
    from tpu_train.data import PaddedInstructionLoader

    examples = []
    for batch in PaddedInstructionLoader(path, tokenizer, batch_size=1):
        if len(examples) >= max_examples:
            break
        prompt = batch["prompt_tokens"][0, -int(batch["prompt_lengths"][0]):][-limit:]
        examples.append((prompt.tolist(), batch["references"][0]))
    return examples


def _until_eos(tokens: list[int], eos_id: int) -> list[int]:
    """The tokens up to and including the first end token (a batch row repeats it after)."""
    return tokens[:tokens.index(eos_id) + 1] if eos_id in tokens else tokens


def _decoded_answers(model, prompts: list[list[int]], eos_id: int,
                     decoding: Decoding) -> list[list[int]]:
    from tpu_train.models import generate

    decoder, max_new_tokens = decoding.decoder, decoding.max_new_tokens
    if decoder is None:
        with autocast_context(decoding.device, decoding.precision):
            return [generate(model, torch.tensor([p], device=decoding.device), max_new_tokens,
                             eos_token_id=eos_id)[0, len(p):].cpu().tolist() for p in prompts]
    answers = []
    for start in range(0, len(prompts), DECODE_BATCH):
        # Every chunk, the last one too, uses the batch bucket of a full chunk: one program.
        new = decoder.generate(prompts[start:start + DECODE_BATCH], max_new_tokens,
                               eos_token_id=eos_id,
                               batch_size=min(DECODE_BATCH, len(prompts)))
        answers.extend(_until_eos(row, eos_id) for row in new.tolist())
    return answers


@torch.no_grad()
def compile_ahead_for_validation(model: torch.nn.Module, evaluator, val_batch,
                                 exact_match: ExactMatchSet, decoding: Decoding) -> None:
    """Start XLA's compiles of the programs a validation pass runs first: ``evaluator``'s (a
    :func:`compiled_loss`) for ``val_batch``, and the decoder's for the first chunk of exact
    match's prompts. Each is traced and lowered here, with the model in eval mode as
    validation has it, and compiled on a thread of its own; the pass waits for them where it
    needs them (``CompileCache.build_ahead``)."""
    model.eval()
    try:
        if evaluator is not None and val_batch is not None:
            evaluator.compile_ahead(val_batch)
        tokenizer = exact_match.tokenizer
        if decoding.decoder is not None and exact_match.path is not None \
                and exact_match.max_examples:
            examples = _exact_match_examples(exact_match.path, tokenizer,
                                             exact_match.max_examples,
                                             model.config.max_seq_len - decoding.max_new_tokens)
            prompts = [p for p, _ in examples]
            if prompts:
                decoding.decoder.compile_ahead(prompts[:DECODE_BATCH], decoding.max_new_tokens,
                                               eos_token_id=tokenizer.eos_id,
                                               batch_size=min(DECODE_BATCH, len(prompts)))
    finally:
        model.train()


@torch.no_grad()
def exact_match_count(model: torch.nn.Module, tokenizer, path: Path, max_examples: int,
                      decoding: Decoding) -> tuple[float, int] | None:
    """(exact match, number of examples scored): greedy-decoded answers to the first
    ``max_examples`` prompts of an instruction/chat file compared with its references. None
    when ``max_examples`` is 0 or the file has no examples.

    With ``decoding.decoder`` the prompts are decoded in batches of ``DECODE_BATCH`` by one
    compiled program; without it one at a time, op by op (an eager batch would need padding
    the eager cache cannot mask).
    """
    from tpu_train.data import exact_match, extract_response

    if max_examples == 0:
        return None
    examples = _exact_match_examples(path, tokenizer, max_examples,
                                     model.config.max_seq_len - decoding.max_new_tokens)
    if not examples:
        return None
    model.eval()
    answers = _decoded_answers(model, [p for p, _ in examples], tokenizer.eos_id, decoding)
    model.train()
    predictions = [extract_response(tokenizer.decode(a, skip_special=False)) for a in answers]
    return exact_match(predictions, [r for _, r in examples]), len(examples)
