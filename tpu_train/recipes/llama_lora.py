"""``recipe=llama_lora``: LoRA adapters on a frozen model; the export has them merged."""

from omegaconf import DictConfig

from tpu_train.trainer.loop import train


def run(cfg: DictConfig) -> None:
    train(cfg, lora=True)
