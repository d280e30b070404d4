"""MLM masking of training rows (BERT's 80/10/10 rule, optional short inputs): the draws of a
row depend only on (seed, epoch, row index), never on the rank or the batch."""

from collections.abc import Sequence

import numpy as np
import torch

from linformer_ds.loss import IGNORE_INDEX


def document_positions(tokens: torch.Tensor, sep_id: int) -> torch.Tensor:
    """``tokens [B, N]`` -> ``position_ids [B, N]``: 0 at every row start and after every
    ``sep_id``, counting up to the next (a packed row's documents each from 0; padding after the
    last sep counts on from 0 too, it is masked)."""
    b, n = tokens.shape
    idx = torch.arange(n).expand(b, n)
    start = torch.zeros(b, n, dtype=torch.bool)
    start[:, 0] = True
    start[:, 1:] = tokens[:, :-1] == sep_id
    return idx - torch.where(start, idx, 0).cummax(dim=1).values


def _row_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator of one row: a function of (seed, epoch, index) only."""
    return np.random.default_rng([seed % 2**63, epoch % 2**63, index % 2**63, 0x4D4C4D])


class MLMMasking:
    """BERT masking: ``mlm_probability`` of the non-special tokens are predicted; of those 80%
    become ``mask_id``, 10% a random non-special token, 10% stay. Special tokens never are.

    Short inputs (BERT's ``short_seq_prob``): that fraction of rows is cut to a length drawn
    uniformly from ``[2, N - 1]``; the rest of the row becomes padding (attention mask 0, no
    labels), so the model also sees short sequences. ``0.0`` (default) leaves rows whole.

    The draws of a row depend only on ``(seed, epoch, sample index)``; the cut is drawn after the
    masking draws, so the masks of uncut rows do not depend on ``short_seq_prob``.

    ``document_sep_id`` (document isolation): the output also holds ``position_ids``
    (:func:`document_positions` of the row before masking); None (default): it does not.
    """

    def __init__(
        self,
        vocab_size: int,
        mask_id: int,
        special_ids: Sequence[int],
        mlm_probability: float = 0.15,
        seed: int = 0,
        pad_id: int = 0,
        short_seq_prob: float = 0.0,
        document_sep_id: int | None = None,
    ) -> None:
        self.document_sep_id = document_sep_id
        if not 0.0 < mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {mlm_probability}")
        if not 0.0 <= short_seq_prob <= 1.0:
            raise ValueError(f"short_seq_prob must be in [0, 1], got {short_seq_prob}")
        self.short_seq_prob = float(short_seq_prob)
        self.vocab_size = int(vocab_size)
        self.mask_id = int(mask_id)
        self.special_ids = sorted({int(s) for s in special_ids} | {int(mask_id), int(pad_id)})
        self.mlm_probability = float(mlm_probability)
        self.seed = int(seed)
        self.pad_id = int(pad_id)
        allowed = np.ones(self.vocab_size, dtype=bool)
        allowed[[s for s in self.special_ids if 0 <= s < self.vocab_size]] = False
        self.random_ids = np.flatnonzero(allowed)
        if len(self.random_ids) == 0:
            raise ValueError("the vocabulary holds no non-special token")
        self._special = torch.tensor(self.special_ids, dtype=torch.long)

    def __call__(
        self, tokens: torch.Tensor, sample_indices: torch.Tensor, epoch: int
    ) -> dict[str, torch.Tensor]:
        """``tokens [B, N]`` -> ``input_ids, attention_mask, labels`` (all ``[B, N]`` long)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, N], got shape {tuple(tokens.shape)}")
        b, n = tokens.shape
        idx = [int(i) for i in torch.as_tensor(sample_indices).reshape(-1).tolist()]
        if len(idx) != b:
            raise ValueError(f"{len(idx)} sample indices for {b} rows")
        u = np.empty((b, n))
        v = np.empty((b, n))
        rnd = np.empty((b, n), dtype=np.int64)
        lengths = np.full(b, n)
        for r, index in enumerate(idx):
            g = _row_rng(self.seed, epoch, index)
            u[r] = g.random(n)
            v[r] = g.random(n)
            rnd[r] = self.random_ids[g.integers(0, len(self.random_ids), n)]
            if self.short_seq_prob > 0.0 and n > 2 and g.random() < self.short_seq_prob:
                lengths[r] = g.integers(2, n)  # in [2, n - 1]
        tokens = tokens.long()
        if (lengths < n).any():  # cut rows: the tail becomes padding
            tail = torch.arange(n)[None, :] >= torch.from_numpy(lengths)[:, None]
            tokens = tokens.masked_fill(tail, self.pad_id)
        special = torch.isin(tokens, self._special)
        selected = torch.from_numpy(u < self.mlm_probability) & ~special
        v_t = torch.from_numpy(v)
        to_mask = selected & (v_t < 0.8)
        to_random = selected & (v_t >= 0.8) & (v_t < 0.9)
        input_ids = tokens.clone()
        input_ids[to_mask] = self.mask_id
        input_ids[to_random] = torch.from_numpy(rnd)[to_random]
        labels = torch.full_like(tokens, IGNORE_INDEX)
        labels[selected] = tokens[selected]
        out = {
            "input_ids": input_ids,
            "attention_mask": (tokens != self.pad_id).long(),
            "labels": labels,
        }
        if self.document_sep_id is not None:
            out["position_ids"] = document_positions(tokens, self.document_sep_id)
        return out
