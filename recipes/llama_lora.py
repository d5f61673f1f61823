"""LoRA fine-tuning: the base model is frozen, low-rank adapters on the attention and MLP
projections train, and the exported model has them merged into its weights.

    tpu-train recipe=llama_lora
    tpu-train recipe=llama_lora model=llama3_2_1b model.checkpoint=/ckpt/Llama-3.2-1B \
              data=jsonl data.path=train.jsonl recipe.lora.rank=16

Copy it to make your own: ``tpu-train recipe=./my_lora.py``.
"""

from omegaconf import DictConfig

from tpu_train import trainer
from tpu_train.parallel.activation_checkpointing import apply_activation_checkpointing
from tpu_train.trainer import ConfigError
from tpu_train.trainer.lora import apply_lora, merge_lora

RECIPE_CONFIG = "llama_lora"


def add_adapters(model, cfg: DictConfig):
    """Freeze ``model`` and wrap the ``recipe.lora.targets`` projections with adapters."""
    lora = cfg.recipe.lora
    try:
        apply_lora(model, list(lora.targets), lora.rank, lora.alpha, lora.dropout)
    except ValueError as exc:
        raise ConfigError(f"recipe.lora.targets: {exc}") from exc
    return model


def main(cfg: DictConfig) -> None:
    job = trainer.start(cfg)
    tokenizer = trainer.build_tokenizer(cfg)
    data = trainer.build_data(job, tokenizer)

    model = add_adapters(trainer.build_model(job, tokenizer), cfg)
    if cfg.trainer.activation_checkpointing:
        apply_activation_checkpointing(model)
    parallel = trainer.parallelize(job, model)
    optimizer = trainer.build_optimizer(model, cfg)  # the adapters only: the rest is frozen
    scheduler = trainer.build_scheduler(optimizer, cfg)
    step = trainer.build_train_step(job, parallel, model, optimizer, scheduler)

    start_step, resumed_from = trainer.resume(job, parallel, step, model, optimizer, scheduler,
                                              data)
    trainer.fit(job, parallel, step, model, optimizer, scheduler, data, tokenizer,
                start_step=start_step, resumed_from=resumed_from,
                source=trainer.describe_source(cfg),
                make_host_model=lambda: add_adapters(
                    trainer.build_model(job, tokenizer, from_checkpoint=False), cfg),
                export_model=lambda: merge_lora(model))
