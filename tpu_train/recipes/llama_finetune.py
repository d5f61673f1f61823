"""``recipe=llama_finetune``: full fine-tuning, optionally from ``model.checkpoint``."""

from omegaconf import DictConfig

from tpu_train.trainer.loop import train


def run(cfg: DictConfig) -> None:
    train(cfg)
