"""Per-sample gradients of embedding matrices kept sparse: sample b's gradient is Σ_t e_{id[b,t]} ⊗ v[b,t], so
it is stored as the token ids (B, T) and row values (B, T, D) instead of a dense (B, vocab, D) tensor (8 GB for
RoBERTa-large at B = 40). Norms come from a T×T Gram matrix per sample; clipped sums scatter into one
(vocab, D) matrix. Static shapes throughout, so it also runs on the meta device."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SparseRows:
    ids: torch.Tensor  # (B, T) row indices
    values: torch.Tensor  # (B, T, D) gradient rows (zero where a row gets none, e.g. padding)
    num_rows: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.ids.shape[0], self.num_rows, self.values.shape[-1]))

    def squared_norms(self) -> torch.Tensor:
        """‖Σ_t e_{id_t} ⊗ v_t‖² = Σ_{t,t'} [id_t = id_t'] ⟨v_t, v_t'⟩, shape (B,)."""
        values = self.values.to(torch.promote_types(self.values.dtype, torch.float32))
        same = (self.ids.unsqueeze(2) == self.ids.unsqueeze(1)).to(values.dtype)
        return (torch.bmm(values, values.transpose(1, 2)) * same).sum((1, 2))

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """Σ_b w_b · g_b as a dense (vocab, D) matrix."""
        out = torch.zeros(self.num_rows, self.values.shape[-1], dtype=self.values.dtype, device=self.values.device)
        rows = (self.values * weights.to(self.values.dtype).view(-1, 1, 1)).reshape(-1, self.values.shape[-1])
        return out.index_add_(0, self.ids.reshape(-1), rows)

    def to_dense(self) -> torch.Tensor:
        batch, dim = self.ids.shape[0], self.values.shape[-1]
        dense = torch.zeros(batch, self.num_rows, dim, dtype=self.values.dtype, device=self.values.device)
        return dense.scatter_add_(1, self.ids.unsqueeze(-1).expand(-1, -1, dim), self.values)

    def __add__(self, other):
        """Two sparse uses concatenate their rows; a dense use (a tied LM head) densifies, since it is already
        a (B, vocab, D) tensor and the norm needs the sum of both parts."""
        if isinstance(other, SparseRows):
            return SparseRows(torch.cat([self.ids, other.ids], 1), torch.cat([self.values, other.values], 1),
                              self.num_rows)
        return self.to_dense() + other

    __radd__ = __add__
