"""Layer structures of models the shipped GPU profiles cover but ``lowcomm.models`` lacks.

The GPU profiles (:mod:`lowcomm.sim.gpu_profiles`) need each model's parameter shapes in
forward order and its FLOPs per layer. ResNet-50 and the LSTM LM come from the registry
(``resnet50_imagenet``, ``lstm_lm``); VGG-16 and BERT-base are not training models of this
library, so they are written here from their published architectures only to be *counted*
(instantiated on the ``meta`` device, never trained): VGG-16 as torchvision's ``vgg16``
(13 convolutions, no batch norm, 4096-4096-1000 head, 138.4 M parameters) and BERT-base as
Devlin et al.'s pre-training model (12 layers, d=768, 12 heads, FFN 3072, vocabulary 30522,
512 positions, MLM head tied to the word embeddings and the next-sentence head, 110 M).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

#: torchvision's configuration "D": channels per convolution, "M" = 2x2 max-pool.
VGG16_CFG: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
                              512, 512, 512, "M", 512, 512, 512, "M"]


class VGG16(nn.Module):
    """ImageNet VGG-16 with torchvision's module names (``features.N``, ``classifier.N``)."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c = 3
        for v in VGG16_CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(c, int(v), 3, padding=1), nn.ReLU(inplace=True)]
                c = int(v)
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(True), nn.Dropout(),
            nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(),
            nn.Linear(4096, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        """Logits of ``x: (B, 3, 224, 224)``."""
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class _Attention(nn.Module):
    """Multi-head self-attention; the score and context matmuls are credited to ``value``
    (the last projection to start before them), as the profiler would."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        """Context vectors ``(B, T, d)``."""
        b, t, d = x.shape
        h = self.heads

        def split(y: Tensor) -> Tensor:
            return y.view(b, t, h, d // h).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // h), dim=-1)
        return (att @ v).transpose(1, 2).reshape(b, t, d)


class _BertLayer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.attention = _Attention(d, heads)
        self.attention_output = nn.Linear(d, d)
        self.attention_norm = nn.LayerNorm(d)
        self.intermediate = nn.Linear(d, ffn)
        self.output = nn.Linear(ffn, d)
        self.output_norm = nn.LayerNorm(d)

    def forward(self, x: Tensor) -> Tensor:
        x = self.attention_norm(x + self.attention_output(self.attention(x)))
        return self.output_norm(x + self.output(nn.functional.gelu(self.intermediate(x))))


class BertBase(nn.Module):
    """BERT-base for pre-training (MLM + NSP heads); ``forward(tokens) -> MLM logits``."""

    def __init__(self, vocab: int = 30522, d: int = 768, layers: int = 12, heads: int = 12,
                 ffn: int = 3072, positions: int = 512) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, d)
        self.position_embeddings = nn.Embedding(positions, d)
        self.token_type_embeddings = nn.Embedding(2, d)
        self.embeddings_norm = nn.LayerNorm(d)
        self.layers = nn.ModuleList(_BertLayer(d, heads, ffn) for _ in range(layers))
        self.pooler = nn.Linear(d, d)
        self.nsp = nn.Linear(d, 2)
        self.mlm_transform = nn.Linear(d, d)
        self.mlm_norm = nn.LayerNorm(d)
        self.mlm_decoder = nn.Linear(d, vocab)
        self.mlm_decoder.weight = self.word_embeddings.weight  # tied, as in BERT

    def forward(self, tokens: Tensor) -> Tensor:
        """MLM logits; the NSP head runs too so that its FLOPs are counted."""
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device).unsqueeze(0)
        x = self.word_embeddings(tokens) + self.position_embeddings(pos) \
            + self.token_type_embeddings(torch.zeros_like(tokens))
        x = self.embeddings_norm(x)
        for layer in self.layers:
            x = layer(x)
        nsp = self.nsp(torch.tanh(self.pooler(x[:, 0])))
        logits = self.mlm_decoder(self.mlm_norm(nn.functional.gelu(self.mlm_transform(x))))
        return logits + 0 * nsp.sum()
