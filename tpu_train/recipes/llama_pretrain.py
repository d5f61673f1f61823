"""``recipe=llama_pretrain``: training from random initialization."""

from omegaconf import DictConfig

from tpu_train.trainer.errors import ConfigError
from tpu_train.trainer.loop import train


def run(cfg: DictConfig) -> None:
    if cfg.model.checkpoint is not None:
        raise ConfigError(
            "recipe=llama_pretrain starts from random weights but model.checkpoint is set; "
            "use recipe=llama_finetune to start from a checkpoint, or set model.checkpoint=null"
        )
    train(cfg)
