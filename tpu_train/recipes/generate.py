"""``recipe=generate``: print continuations of ``recipe.generate.prompts``."""

import torch
from omegaconf import DictConfig

from tpu_train.trainer import builders
from tpu_train.trainer.evaluation import evaluation_device
from tpu_train.trainer.inference import load_model_for_inference
from tpu_train.trainer.validation import validate_config


def run(cfg: DictConfig) -> None:
    from tpu_train.models import generate

    validate_config(cfg)
    # Op-by-op evaluation and sampling run on the CPU when the tpu device is the CPU client.
    device = evaluation_device(builders.resolve_device(cfg.trainer.device))
    tokenizer = builders.build_tokenizer(cfg)
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
