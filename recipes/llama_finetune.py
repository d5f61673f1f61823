"""Full fine-tuning of a Llama: every parameter trains.

    tpu-train recipe=llama_finetune                       # the bundled base model and task
    tpu-train recipe=llama_finetune model=llama3_2_1b model.checkpoint=/ckpt/Llama-3.2-1B \
              data=jsonl data.path=train.jsonl parallel.fsdp=-1 parallel.data=1

The script is the steps of training; copy it to change any of them and run the copy with
``tpu-train recipe=./my_recipe.py`` (it composes the ``RECIPE_CONFIG`` config). What
``trainer.assemble`` builds, block by block: ``tpu_train/trainer/run.py``.
"""

from omegaconf import DictConfig

from tpu_train import trainer

RECIPE_CONFIG = "llama_finetune"


def main(cfg: DictConfig) -> None:
    # Checks, processes (under a launcher), seed and device; nothing is written yet.
    job = trainer.start(cfg)
    # Tokenizer, data, the model (model.checkpoint when set), its layout (a mesh and sharding
    # plan when compiled, FSDP2 + TP per device when eager), optimizer, schedule and step.
    run = trainer.assemble(job)
    # Resume from run.dir's newest checkpoint (any mesh, any process count), then train.
    trainer.fit(trainer.resume(run))
