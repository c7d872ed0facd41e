"""The drafter's lightweight heads: the sequential heads, which add a bias ``B_k`` to the backbone's logits ``U_k`` from
the previous token (``markov``), gated by the block hidden state (``gated``), or through a recurrent state over the
block (``rnn``); and the confidence head, the probability that a draft token is accepted given the ones before it.

This file is self-contained (torch + its sibling ``configuration_dspark``): drafter folders carry it beside
``modeling_dspark.py`` for ``trust_remote_code``.
"""

from __future__ import annotations

import torch
from torch import nn

from .configuration_dspark import DSparkConfig


class DSparkMarkovHead(nn.Module):
    """First-order Markov bias ``B(x_prev) = W2 W1[x_prev]`` (the reference's "vanilla" head)."""

    stateful = False

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(config.vocab_size, config.markov_rank)
        self.markov_w2 = nn.Linear(config.markov_rank, config.output_vocab_size, bias=False)

    def initial_state(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return None

    def step(self, prev_ids, hidden, state):
        """Bias for one position. prev_ids [batch], hidden [batch, d] -> (bias [batch, V], new state)."""
        return self.markov_w2(self.markov_w1(prev_ids)), state

    def teacher_forced(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Biases for a whole block with known previous tokens. prev_ids [..., g], hidden [..., g, d]."""
        return self.markov_w2(self.markov_w1(prev_ids))


class DSparkGatedHead(DSparkMarkovHead):
    """``B = W2(sigmoid(Wg [h_k ; W1[x_prev]]) * W1[x_prev])``."""

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        self.gate_proj = nn.Linear(config.hidden_size + config.markov_rank, config.markov_rank)

    def _bias(self, prev_ids, hidden):
        embedded = self.markov_w1(prev_ids)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, embedded.to(hidden.dtype)], dim=-1)))
        return self.markov_w2(gate * embedded)

    def step(self, prev_ids, hidden, state):
        return self._bias(prev_ids, hidden), state

    def teacher_forced(self, prev_ids, hidden):
        return self._bias(prev_ids, hidden)


class DSparkRNNHead(DSparkMarkovHead):
    """Gated recurrent state over the block: ``z = [s_{k-1}; W1[x_prev]; h_k]``, one projection to
    (gate, candidate, output); ``s_k = sig(g) s_{k-1} + (1 - sig(g)) tanh(c)``; ``B = W2 tanh(o)``; ``s_0 = 0``."""

    stateful = True

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        self.joint_proj = nn.Linear(2 * config.markov_rank + config.hidden_size, 3 * config.markov_rank)

    def initial_state(self, hidden):
        return hidden.new_zeros(*hidden.shape[:-2], self.markov_w1.embedding_dim)

    def step(self, prev_ids, hidden, state):
        embedded = self.markov_w1(prev_ids)
        gate, candidate, output = self.joint_proj(torch.cat([state, embedded, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(output)), state

    def teacher_forced(self, prev_ids, hidden):
        state, biases = self.initial_state(hidden), []
        for k in range(prev_ids.shape[-1]):
            bias, state = self.step(prev_ids[..., k], hidden[..., k, :], state)
            biases.append(bias)
        return torch.stack(biases, dim=-2)


SEQUENTIAL_HEADS = {"markov": DSparkMarkovHead, "gated": DSparkGatedHead, "rnn": DSparkRNNHead}


class DSparkConfidenceHead(nn.Module):
    """``c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b)``: probability that draft token k is accepted given that
    tokens 1..k-1 were. Returns logits; ``DSparkDrafter.confidences`` applies calibration and the sigmoid."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.proj = nn.Linear(config.confidence_input_size, 1)

    def forward(self, hidden: torch.Tensor, prev_embedding: torch.Tensor | None) -> torch.Tensor:
        features = hidden if prev_embedding is None else torch.cat([hidden, prev_embedding.to(hidden.dtype)], dim=-1)
        return self.proj(features).squeeze(-1)


__all__ = ["DSparkConfidenceHead", "DSparkGatedHead", "DSparkMarkovHead", "DSparkRNNHead", "SEQUENTIAL_HEADS"]
