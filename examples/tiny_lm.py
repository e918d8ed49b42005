"""A small transformer language model on generated text: sequences from a fixed random Markov
chain over ``VOCAB`` tokens (peaked transitions), and a one-layer causal transformer for them.
Used by the compact-state training tests and the 8-bit precision benchmark; not needed by the
optimizers."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

VOCAB, LENGTH = 12, 32


def markov_text(n: int, seed: int = 0) -> Tensor:
    """n sequences of LENGTH + 1 tokens from the chain (its transitions fixed; ``seed`` draws the
    sequences)."""
    transitions = torch.softmax(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(42)) * 3, dim=1)
    g = torch.Generator().manual_seed(seed)
    seqs = torch.empty(n, LENGTH + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(LENGTH):
        seqs[:, t + 1] = torch.multinomial(transitions[seqs[:, t]], 1, generator=g).squeeze(1)
    return seqs


class TinyLM(nn.Module):
    """Token and position embeddings (32 wide), one causal transformer layer, a linear head."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.randn(LENGTH, width) * 0.02)
        self.layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.layer(self.embed(tokens) + self.position[:tokens.shape[1]], src_mask=mask,
                                    is_causal=True))


def lm_loss(model: nn.Module, batch: Tensor) -> Tensor:
    """Next-token cross-entropy over a batch of sequences."""
    return F.cross_entropy(model(batch[:, :-1]).reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
