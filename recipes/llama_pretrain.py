"""Pretraining a Llama from random initialization (warmup-stable-decay schedule by default).

    tpu-train recipe=llama_pretrain trainer.max_steps=500
    tpu-train recipe=llama_pretrain model=llama3_1_8b data=jsonl data.path=corpus.jsonl \
              parallel.data=1 parallel.fsdp=-1 trainer.precision=bf16

Copy it to make your own: ``tpu-train recipe=./my_pretrain.py``.
"""

from omegaconf import DictConfig

from tpu_train import trainer
from tpu_train.parallel.activation_checkpointing import apply_activation_checkpointing
from tpu_train.trainer import ConfigError

RECIPE_CONFIG = "llama_pretrain"


def main(cfg: DictConfig) -> None:
    if cfg.model.checkpoint is not None:
        raise ConfigError(
            "recipe=llama_pretrain starts from random weights but model.checkpoint is set; "
            "use recipe=llama_finetune to start from a checkpoint, or set model.checkpoint=null")
    job = trainer.start(cfg)
    tokenizer = trainer.build_tokenizer(cfg)
    data = trainer.build_data(job, tokenizer, bundled="prose")  # unless data.path is set

    model = trainer.build_model(job, tokenizer)  # seeded random initialization
    if cfg.trainer.activation_checkpointing:
        apply_activation_checkpointing(model)
    parallel = trainer.parallelize(job, model)
    optimizer = trainer.build_optimizer(model, cfg)
    scheduler = trainer.build_scheduler(optimizer, cfg)
    step = trainer.build_train_step(job, parallel, model, optimizer, scheduler)

    start_step, resumed_from = trainer.resume(job, parallel, step, model, optimizer, scheduler,
                                              data)
    trainer.fit(job, parallel, step, model, optimizer, scheduler, data, tokenizer,
                start_step=start_step, resumed_from=resumed_from,
                source=trainer.describe_source(cfg),
                make_host_model=lambda: trainer.build_model(job, tokenizer))
