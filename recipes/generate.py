"""Greedy or sampled continuations of ``recipe.generate.prompts``.

    tpu-train recipe=generate model.checkpoint=runs/llama_finetune/<stamp>/hf \
              'recipe.generate.prompts=["add 12+30\n"]' recipe.generate.temperature=0.7

The model is ``model.checkpoint``, else the newest intact checkpoint in ``run.dir``; neither
is a one-line error.
"""

import torch
from omegaconf import DictConfig

from tpu_train import trainer
from tpu_train.models import generate
from tpu_train.trainer.evaluation import evaluation_device
from tpu_train.trainer.inference import load_model_for_inference

RECIPE_CONFIG = "generate"


def main(cfg: DictConfig) -> None:
    job = trainer.start(cfg)
    # Op-by-op sampling runs on the CPU when the tpu device is the CPU client.
    device = evaluation_device(job.device)
    tokenizer = trainer.build_tokenizer(cfg)
    model, source = load_model_for_inference(cfg, tokenizer, device)
    print(f"model: {source}")
    options = cfg.recipe.generate
    generator = torch.Generator().manual_seed(cfg.trainer.seed)
    for prompt in options.prompts:
        ids = torch.tensor([[tokenizer.bos_id] + tokenizer.encode(prompt)])
        out = generate(model, ids.to(device), options.max_new_tokens,
                       temperature=options.temperature, top_p=options.top_p,
                       eos_token_id=tokenizer.eos_id, generator=generator)
        completion = tokenizer.decode(out[0, ids.shape[1]:].cpu().tolist(), skip_special=True)
        print(f"--- prompt: {prompt!r}\n{completion}")
