"""Pretraining a Llama from random initialization (warmup-stable-decay schedule by default).

    tpu-train recipe=llama_pretrain trainer.max_steps=500
    tpu-train recipe=llama_pretrain model=llama3_1_8b data=jsonl data.path=corpus.jsonl \
              parallel.data=1 parallel.fsdp=-1 trainer.precision=bf16

Copy it to make your own: ``tpu-train recipe=./my_pretrain.py``.
"""

from omegaconf import DictConfig

from tpu_train import trainer
from tpu_train.trainer import ConfigError

RECIPE_CONFIG = "llama_pretrain"


def main(cfg: DictConfig) -> None:
    if cfg.model.checkpoint is not None:
        raise ConfigError(
            "recipe=llama_pretrain starts from random weights but model.checkpoint is set; "
            "use recipe=llama_finetune to start from a checkpoint, or set model.checkpoint=null")
    job = trainer.start(cfg)
    # A seeded random model; the bundled prose corpus unless data.path is set.
    run = trainer.assemble(job, bundled="prose")
    trainer.fit(trainer.resume(run))
