r"""Greedy or sampled continuations of ``recipe.generate.prompts``.

    tpu-train recipe=generate model.checkpoint=runs/llama_finetune/<stamp>/hf \
              'recipe.generate.prompts=["add 12+30\n"]' recipe.generate.temperature=0.7

In a prompt ``\n`` is a newline, ``\t`` a tab and ``\\`` a backslash: the shell and Hydra pass
a backslash on as typed, and the prompts of the bundled task end in a newline.

The model is ``model.checkpoint``, else the newest intact checkpoint in ``run.dir``; neither
is a one-line error. On the ``tpu`` device all prompts are continued together by one compiled
program (tpu_train.compile.decoding; sampling seeded by ``trainer.seed``), on the CPU one at a
time, op by op; both in ``trainer.precision`` (bf16: under bf16 autocast).
"""

import re

import torch
from omegaconf import DictConfig

from tpu_train import trainer
from tpu_train.models import generate
from tpu_train.trainer.evaluation import compiled_decoder, decodes_compiled, describe_decoder
from tpu_train.trainer.inference import load_model_for_inference
from tpu_train.trainer.step import autocast_context

RECIPE_CONFIG = "generate"

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape(prompt: str) -> str:
    """``prompt`` with ``\\n``, ``\\t`` and ``\\\\`` made a newline, a tab and a backslash."""
    return re.sub(r"\\([nt\\])", lambda match: _ESCAPES[match[1]], prompt)


def main(cfg: DictConfig) -> None:
    job = trainer.start(cfg)
    tokenizer = trainer.build_tokenizer(cfg)
    model, source = load_model_for_inference(cfg, tokenizer, job.device)
    print(f"model: {source}")
    options = cfg.recipe.generate
    texts = [unescape(prompt) for prompt in options.prompts]
    prompts = [[tokenizer.bos_id] + tokenizer.encode(text) for text in texts]
    if decodes_compiled(job.device):
        decoder = compiled_decoder(model, job.precision)
        completions = decoder.generate(prompts, options.max_new_tokens,
                                       temperature=options.temperature, top_p=options.top_p,
                                       eos_token_id=tokenizer.eos_id,
                                       seed=cfg.trainer.seed).tolist()
        print(describe_decoder(decoder))
    else:
        generator = torch.Generator().manual_seed(cfg.trainer.seed)
        with autocast_context(job.device, job.precision):
            completions = [generate(model, torch.tensor([ids]), options.max_new_tokens,
                                    temperature=options.temperature, top_p=options.top_p,
                                    eos_token_id=tokenizer.eos_id,
                                    generator=generator)[0, len(ids):].tolist() for ids in prompts]
    for prompt, tokens in zip(texts, completions):
        print(f"--- prompt: {prompt!r}\n{tokenizer.decode(tokens, skip_special=True)}")
