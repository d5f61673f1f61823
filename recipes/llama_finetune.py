"""Full fine-tuning of a Llama: every parameter trains.

    tpu-train recipe=llama_finetune                       # the bundled base model and task
    tpu-train recipe=llama_finetune model=llama3_2_1b model.checkpoint=/ckpt/Llama-3.2-1B \
              data=jsonl data.path=train.jsonl parallel.fsdp=-1 parallel.data=1

The script assembles the trainer's blocks in order; copy it to change any of them and run the
copy with ``tpu-train recipe=./my_recipe.py`` (it composes the ``RECIPE_CONFIG`` config).
"""

from omegaconf import DictConfig

from tpu_train import trainer
from tpu_train.parallel.activation_checkpointing import apply_activation_checkpointing

RECIPE_CONFIG = "llama_finetune"


def main(cfg: DictConfig) -> None:
    # Checks, processes (under a launcher), seed and device; nothing is written yet.
    job = trainer.start(cfg)
    tokenizer = trainer.build_tokenizer(cfg)
    data = trainer.build_data(job, tokenizer)

    # The model on the CPU, loaded from model.checkpoint when set.
    model = trainer.build_model(job, tokenizer)
    if cfg.trainer.activation_checkpointing:
        apply_activation_checkpointing(model)

    # Mesh and sharding plan (compiled) or FSDP2 + TP (eager, one process per device).
    parallel = trainer.parallelize(job, model)
    optimizer = trainer.build_optimizer(model, cfg)
    scheduler = trainer.build_scheduler(optimizer, cfg)
    step = trainer.build_train_step(job, parallel, model, optimizer, scheduler)

    # Resume from run.dir's newest checkpoint (any mesh, any process count), then train.
    start_step, resumed_from = trainer.resume(job, parallel, step, model, optimizer, scheduler,
                                              data)
    trainer.fit(job, parallel, step, model, optimizer, scheduler, data, tokenizer,
                start_step=start_step, resumed_from=resumed_from,
                source=trainer.describe_source(cfg),
                make_host_model=lambda: trainer.build_model(job, tokenizer, from_checkpoint=False))
