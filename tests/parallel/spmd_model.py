"""The tiny Llama, batches and loss shared by the multi-process SPMD tests and their workers."""

import torch
import torch.nn.functional as F

from tpu_train.models import Llama, LlamaConfig

CFG = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=128,
                  ffn_hidden_dim=128, max_seq_len=16)
GLOBAL_BATCH = 8  # splits over 1, 2, 4 and 8 devices


def init_model() -> Llama:
    model = Llama(CFG)
    model.init_weights(seed=0, device="cpu")
    return model


def loss_fn(model, batch):
    logits = model(batch["tokens"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def batches(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        t = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.max_seq_len + 1), generator=g)
        out.append({"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()})
    return out
