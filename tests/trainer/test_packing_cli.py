"""``tpu-train recipe=llama_finetune data.packing=true``: the packed batches carry segment and
position ids through the CLI's compiled step (and its eager step on the CPU), which then
computes every sample as if it were alone in its row. The step-1 loss (the initial weights) is
checked against the oracle: each sample of the first batch run alone on the CPU, its losses
summed over the batch's targets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from tests.trainer.cli_helpers import TINY, TINY_COMPILED, read_metrics, run_in_process
from tpu_train.trainer import builders
from tpu_train.trainer.run_dirs import SAVED_CONFIG_FILE
from tpu_train.trainer.step import IGNORE_INDEX, causal_lm_loss_sum


def _each_sample_alone(model, batch) -> float:
    """The mean next-token loss of the batch's targets, every sample (segment) run alone."""
    total, count = 0.0, 0
    for row in range(batch["tokens"].shape[0]):
        segments = batch["segment_ids"][row]
        for segment in segments.unique():
            where = segments == segment
            tokens, labels = batch["tokens"][row][where], batch["labels"][row][where]
            logits = model(tokens[None])[0]
            total += float(F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX,
                                           reduction="sum"))
            count += int((labels != IGNORE_INDEX).sum())
    return total / count


@pytest.mark.parametrize("mode", ["compiled", "eager"])
def test_packing_true_trains_on_each_sample_alone(tmp_path, mode):
    run_dir = tmp_path / "run"
    # The compiled run validates too (its compiled loss over packed validation batches).
    shapes = [*TINY_COMPILED, "trainer.val_every_n_steps=1"] if mode == "compiled" else TINY
    code, out, err = run_in_process("recipe=llama_finetune", *shapes, "data.packing=true",
                                    "trainer.max_steps=1", f"run.dir={run_dir}")
    assert code == 0, err
    step_one = read_metrics(run_dir)[1]["train/loss"]

    # The run's own first batch and initial weights, rebuilt from its saved config.
    cfg = OmegaConf.load(run_dir / SAVED_CONFIG_FILE)
    tokenizer = builders.build_tokenizer(cfg)
    model = builders.build_model(cfg, tokenizer.vocab_size)
    train_path, _ = builders.data_paths(cfg, "tasks")
    batch = next(builders.build_train_loader(cfg, tokenizer, train_path))
    assert set(batch) == {"tokens", "labels", "segment_ids", "position_ids"}
    assert int(batch["segment_ids"].max()) > 1  # several samples in a row
    targets = int((batch["labels"] != IGNORE_INDEX).sum())
    with torch.no_grad():
        alone = _each_sample_alone(model, batch)
        unmasked = float(causal_lm_loss_sum(model, {"tokens": batch["tokens"],
                                                    "labels": batch["labels"]})) / targets
    assert abs(step_one - alone) <= 1e-5 * alone, (step_one, alone)
    # Without the segment ids the same batch gives another loss, which the run did not log.
    assert abs(unmasked - alone) > 100 * abs(step_one - alone), (unmasked, alone, step_one)
