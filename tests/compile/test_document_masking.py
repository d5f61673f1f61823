"""Packed rows with document masking: each sample of a row computed as if it were alone.

Samples of different lengths are packed into one row with the packer's segment and position
ids; the per-token losses of every sample must equal those of the sample run alone (CPU
PyTorch, the oracle), op by op on the CPU and on the ``tpu`` device, and in a compiled
program; without the mask the same comparison must fail. A compiled training step on packed
rows follows eager CPU PyTorch step for step."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from tpu_train.compile import compile_train_step, lower_train_step
from tpu_train.compile.evaluation import CompiledLoss
from tpu_train.data.packing import IGNORE_INDEX, segments_and_positions

from tests.platforms import PLATFORM
from tests.tolerances import CROSS_ENTROPY_FUNCTIONS, llama_functions, loss_rtol

from .helpers import DEVICE, OPTIMIZERS, run_reference, tiny_llama, to_device
from tests.markers import needs_libtpu

LENGTHS = (5, 11, 3, 13)  # one 32-token row (the tiny model's max_seq_len)


def _samples(lengths=LENGTHS, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g) for n in lengths]


def _packed_row(samples, masked=True):
    """One row of the samples: tokens, labels that never cross a sample, and (``masked``)
    the packer's segment and position ids."""
    tokens = torch.cat(samples)[None]
    labels = torch.cat([torch.cat([s[1:], torch.tensor([IGNORE_INDEX])]) for s in samples])[None]
    batch = {"tokens": tokens, "labels": labels}
    if masked:
        starts = torch.cat([torch.arange(len(s)) == 0 for s in samples]).tolist()
        batch.update(segments_and_positions([starts], tokens.shape[1]))
    return batch


def _token_losses(model, batch):
    inputs = {k: batch[k] for k in ("position_ids", "segment_ids") if k in batch}
    logits = model(batch["tokens"], **inputs).float()
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="none").reshape(batch["labels"].shape)


def _alone(model, samples):
    """Per-token losses of each sample run alone (its last token has no label)."""
    with torch.no_grad():
        return [_token_losses(model, _packed_row([s], masked=False))[0, :-1] for s in samples]


def _per_sample(row_losses, samples):
    out, start = [], 0
    for s in samples:
        out.append(row_losses[start:start + len(s) - 1])
        start += len(s)
    return out


# A token's loss from the packed row against the same sample alone: 1e-5 on the CPU client;
# on a chip the forward's derived bound (float32, the SwiGLU hidden size 176 as the longest
# reduction, two layers with their elementwise functions and the cross-entropy's) times the
# loss's size, log(vocab 128) for the untrained model.
TOKEN_LOSS_BOUND = 1e-5 if PLATFORM == "cpu" else (
    loss_rtol(torch.float32, 1, 176, depth=2,
              functions=llama_functions(2) + CROSS_ENTROPY_FUNCTIONS) * math.log(128))


def _largest_difference(got, want):
    return max(float((g.detach().cpu() - w.detach()).abs().max()) for g, w in zip(got, want))


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def test_the_packer_starts_segments_and_positions_at_every_sample():
    ids = segments_and_positions([[True, False, False, True, False, True, False, False]], 7)
    assert ids["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 3, 3]]
    assert ids["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    # A row that begins inside a sample begins a segment at position 0.
    ids = segments_and_positions([[False, False, True, False]], 3)
    assert ids["segment_ids"].tolist() == [[1, 1, 2]] and ids["position_ids"].tolist() == [[0, 1, 0]]


@pytest.mark.parametrize("where", ["cpu", "tpu"])
def test_eager_packed_losses_equal_each_sample_alone(model, where):
    samples = _samples()
    want = _alone(model, samples)
    on = model if where == "cpu" else copy.deepcopy(model).to(DEVICE)
    with torch.no_grad():
        packed = _token_losses(on, to_device(_packed_row(samples), on.rope_cos.device))[0]
        unmasked = _token_losses(on, to_device(_packed_row(samples, masked=False),
                                               on.rope_cos.device))[0]
    assert _largest_difference(_per_sample(packed, samples), want) <= TOKEN_LOSS_BOUND
    # Without the mask the later samples see the earlier ones: the same check fails.
    assert _largest_difference(_per_sample(unmasked, samples), want) > 1e-2


def _sample_loss(model, batch):
    return (_token_losses(model, batch) * batch["weight"]).sum()


def test_compiled_packed_losses_equal_each_sample_alone(model):
    """One program (a loss weighted per token, one sample's tokens at a time) over the
    packed row, against each sample alone on the CPU."""
    samples = _samples()
    want = [float(losses.sum()) for losses in _alone(model, samples)]
    on_device = copy.deepcopy(model).to(DEVICE)
    evaluator = CompiledLoss(on_device, _sample_loss)
    got, unmasked, start = [], [], 0
    for s in samples:
        weight = torch.zeros(1, sum(LENGTHS))
        weight[0, start:start + len(s) - 1] = 1.0
        start += len(s)
        got.append(evaluator({**_packed_row(samples), "weight": weight}))
        unmasked.append(evaluator({**_packed_row(samples, masked=False), "weight": weight}))
    assert len(evaluator.compilations) == 2  # masked and unmasked: one program each
    assert max(abs(g - w) / len(s) for g, w, s in zip(got, want, samples)) <= TOKEN_LOSS_BOUND
    assert max(abs(g - w) / len(s) for g, w, s in zip(unmasked, want, samples)) > 1e-2


def _mean_loss(model, batch):
    return _token_losses(model, batch).sum() / (batch["labels"] != IGNORE_INDEX).sum()


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_a_compiled_step_on_packed_rows_follows_eager_pytorch(model, scan_layers):
    """Forward and backward through the mask: the compiled step's losses are CPU PyTorch's,
    and its first loss is the token-weighted mean of the samples alone; also with the layers
    scanned (the mask and the per-token rotary tables are inputs of the loop's body)."""
    rows = [_samples(seed=3), _samples((7, 7, 9, 9), seed=4)]
    batches = [{k: torch.cat([_packed_row(r)[k] for r in rows]) for k in _packed_row(rows[0])}
               for _ in range(3)]
    make_opt = OPTIMIZERS["adamw"]
    cpu_losses, *_ = run_reference(model, make_opt, _mean_loss, batches, device="cpu")
    on_device = copy.deepcopy(model).to(DEVICE)
    step = compile_train_step(on_device, make_opt(on_device.parameters()), _mean_loss,
                              scan_layers=scan_layers)
    losses = [float(step(to_device(b))["loss"].cpu()) for b in batches]
    for got, want in zip(losses, cpu_losses):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, cpu_losses)
    alone = torch.cat([torch.cat(_alone(model, r)) for r in rows])
    assert abs(losses[0] - float(alone.mean())) <= 1e-5 * float(alone.mean())




@needs_libtpu
def test_a_v5e_step_on_packed_rows_runs_the_kernels_with_segment_ids():
    """Lowered for a v5e (compile-only target), a bf16 step over packed rows of 1024 tokens
    takes the kernels (forward, dK/dV and dQ) with the rows' segment ids: each kernel call
    reads two more operands than the same call of the causal step (the query's and the keys'
    segment ids; the XLA form is only the other branch of the check that the mask is a
    document mask)."""
    from tests.compile.test_attention_kernels import _meta_llama

    model, optimizer, batch = _meta_llama(1024, 1)
    with torch.device("meta"):
        packed = {**batch, "segment_ids": torch.empty(1, 1024, dtype=torch.int64),
                  "position_ids": torch.empty(1, 1024, dtype=torch.int64)}
    texts = [lower_train_step(model, optimizer, _mean_loss, b, target="v5e", compile=False,
                              autocast_dtype=torch.bfloat16,
                              compute_dtype=torch.bfloat16).lowered.as_text()
             for b in (packed, batch)]
    with_segments, causal = (_kernel_operands(text) for text in texts)
    assert len(with_segments) == len(causal) == 3
    assert with_segments == [n + 2 for n in causal]


def _kernel_operands(text: str) -> list[int]:
    """The operand count of each kernel call of a lowered (StableHLO) module, sorted."""
    counts = []
    for line in text.splitlines():
        if "@tpu_custom_call(" in line:
            operands = line.split("@tpu_custom_call(", 1)[1].split(")", 1)[0]
            counts.append(len([o for o in operands.split(",") if o.strip()]))
    return sorted(counts)
