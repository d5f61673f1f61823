"""Validation loss, perplexity and exact match of a model on instruction or chat data.

    tpu-train recipe=eval run.dir=runs/llama_finetune/<stamp>       # its newest checkpoint
    tpu-train recipe=eval model.checkpoint=runs/llama_finetune/<stamp>/hf data=jsonl \
              data.path=train.jsonl data.val_path=val.jsonl

The model is ``model.checkpoint``, else the newest intact checkpoint in ``run.dir``; neither
is a one-line error. On the ``tpu`` device the answers for exact match are decoded by a compiled
program (tpu_train.compile.decoding), on the CPU op by op.
"""

from omegaconf import DictConfig

from tpu_train import trainer
from tpu_train.trainer import ConfigError, builders
from tpu_train.trainer.evaluation import (Decoding, compiled_decoder, decodes_compiled,
                                          describe_decoder, evaluation_device, exact_match_count,
                                          validation_loss)
from tpu_train.trainer.inference import load_model_for_inference

RECIPE_CONFIG = "eval"


def main(cfg: DictConfig) -> None:
    job = trainer.start(cfg)
    # The op-by-op loss runs on the CPU when the tpu device is the CPU client.
    device = evaluation_device(job.device)
    tokenizer = trainer.build_tokenizer(cfg)
    _, val_path = builders.data_paths(cfg, tokenizer=tokenizer)
    if val_path is None:
        raise ConfigError("recipe=eval needs validation data: set data.val_path")
    loader = builders.build_val_loader(cfg, tokenizer, val_path)
    model, source = load_model_for_inference(cfg, tokenizer, device)
    options = cfg.recipe.eval
    results = validation_loss(model, loader, device, options.batches, job.precision)
    decoder = None
    if builders.first_record_kind(val_path) in ("instruction", "chat"):
        if decodes_compiled(job.device):
            device = job.device
            decoder = compiled_decoder(model.to(device), job.precision)
        decoding = Decoding(device, job.precision, options.max_new_tokens, decoder)
        scored = exact_match_count(model, tokenizer, val_path, options.exact_match_examples,
                                   decoding)
        if scored is not None:
            results["exact_match"], examples = scored
    print(f"model: {source}")
    if decoder is not None:
        print(describe_decoder(decoder))
    print(f"data: {val_path}")
    # How many examples the exact match is over: recipe.eval.exact_match_examples (or fewer
    # in the file), not necessarily the number validation uses during training.
    print(" | ".join(f"{key} {value:.4f}" + (f" on {examples} examples" if key == "exact_match"
                                             else "") for key, value in results.items()))
