"""``recipe=eval``: validation loss, perplexity and exact match."""

from omegaconf import DictConfig

from tpu_train.trainer import builders
from tpu_train.trainer.config import Precision
from tpu_train.trainer.errors import ConfigError
from tpu_train.trainer.evaluation import evaluation_device, exact_match_score, validation_loss
from tpu_train.trainer.inference import load_model_for_inference
from tpu_train.trainer.validation import validate_config


def run(cfg: DictConfig) -> None:
    validate_config(cfg)
    # Op-by-op evaluation and sampling run on the CPU when the tpu device is the CPU client.
    device = evaluation_device(builders.resolve_device(cfg.trainer.device))
    tokenizer = builders.build_tokenizer(cfg)
    _, val_path = builders.data_paths(cfg)
    if val_path is None:
        raise ConfigError("recipe=eval needs validation data: set data.val_path")
    loader = builders.build_val_loader(cfg, tokenizer, val_path)
    model, source = load_model_for_inference(cfg, tokenizer, device)
    options = cfg.recipe.eval
    results = validation_loss(model, loader, device, options.batches, Precision(cfg.trainer.precision))
    if builders.first_record_kind(val_path) in ("instruction", "chat"):
        score = exact_match_score(model, tokenizer, val_path, device,
                                  options.exact_match_examples, options.max_new_tokens)
        if score is not None:
            results["exact_match"] = score
    print(f"model: {source}")
    print(f"data: {val_path}")
    print(" | ".join(f"{key} {value:.4f}" for key, value in results.items()))
