"""A tiny random BERT classifier and batches for the split fine-tuning tests (no checkpoint).

Dropout is off (``dropout=0``) so a split step and an unsplit step see the same function; the
tests compare the two paths, not dropout masks.
"""

from __future__ import annotations

import torch

from lowcomm.split.bert import BertClassifier, BertConfig

VOCAB, HIDDEN, LAYERS, HEADS, FFN, CLASSES = 50, 32, 3, 4, 64, 3


def tiny_classifier(seed: int = 0, *, layers: int = LAYERS) -> BertClassifier:
    """3 layers, hidden 32, FFN 64, 4 heads, 50 words, 3 classes; weights from ``seed``.

    The encoder's init is BERT's (std 0.02); the LayerNorm and bias terms are then perturbed so
    that no parameter is a constant 0/1 whose gradient could hide a wrong cut.
    """
    config = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS,
                        intermediate_size=FFN, max_position_embeddings=16, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    model = BertClassifier(config, CLASSES, dropout=0.0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def tiny_batch(seed: int = 1, batch: int = 4, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, right-padded attention_mask, labels) with lengths from 2 to ``seq``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    lengths = torch.randint(2, seq + 1, (batch,), generator=g)
    lengths[0] = seq  # one full row
    mask = (torch.arange(seq)[None] < lengths[:, None]).to(torch.int64)
    ids = ids * mask  # padding id 0
    labels = torch.randint(0, CLASSES, (batch,), generator=g)
    return ids, mask, labels
