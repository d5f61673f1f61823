"""LoRA fine-tuning: the base model is frozen, low-rank adapters on the attention and MLP
projections train, and the exported model has them merged into its weights.

    tpu-train recipe=llama_lora
    tpu-train recipe=llama_lora model=llama3_2_1b model.checkpoint=/ckpt/Llama-3.2-1B \
              data=jsonl data.path=train.jsonl recipe.lora.rank=16

Copy it to make your own: ``tpu-train recipe=./my_lora.py``.
"""

from omegaconf import DictConfig

from tpu_train import trainer
from tpu_train.trainer import ConfigError
from tpu_train.trainer.lora import apply_lora, merge_lora

RECIPE_CONFIG = "llama_lora"


def main(cfg: DictConfig) -> None:
    lora = cfg.recipe.lora

    def add_adapters(model):
        """Freeze ``model`` and wrap the ``recipe.lora.targets`` projections with adapters."""
        try:
            apply_lora(model, list(lora.targets), lora.rank, lora.alpha, lora.dropout)
        except ValueError as exc:
            raise ConfigError(f"recipe.lora.targets: {exc}") from exc
        return model

    job = trainer.start(cfg)
    # Every model built for the run gets the adapters (the optimizer sees only them); the
    # export merges them into the weights.
    run = trainer.assemble(job, adapt=add_adapters, export=merge_lora)
    trainer.fit(trainer.resume(run))
