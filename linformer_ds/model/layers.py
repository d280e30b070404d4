"""The blocks around attention: the feed-forward network, the local mixer and the encoder layer."""

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .attention import LinformerSelfAttention
from .config import ModelConfig
from .documents import Documents, document_starts
from .window import LocalContext


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class LocalMixer(nn.Module):
    """Depthwise mixing of neighbouring tokens: ``y[i] = sum_o w[o] * x[i + o]`` over offsets
    ``o`` in ``[-r, r]`` (``r = kernel // 2``), per channel, where ``x[i + o]`` counts only if it
    lies in the row, in ``i``'s document and is not padding (:func:`local_mixer_valid`)."""

    def __init__(self, hidden_size: int, kernel: int):
        super().__init__()
        self.radius = kernel // 2
        self.weight = nn.Parameter(torch.empty(2 * self.radius + 1, hidden_size))
        self.mixer_init = True  # init_weights: normal(std)

    def forward(self, x: torch.Tensor, mixing: "LocalMixing") -> torch.Tensor:
        """``x [B, n, D]`` -> ``[B, n, D]``, with ``mixing`` from ``LinformerEncoder._mixing``."""
        r, n = self.radius, x.shape[1]
        if mixing.valid.shape[0] != 2 * r + 1:
            raise ValueError(f"mixing is for kernel {mixing.valid.shape[0]}, not {2 * r + 1}")
        # the r rows either side: zeros at the row ends, the neighbours' rows under sequence
        # parallelism (their gradients go back to the ranks that hold them)
        xp = F.pad(x, (0, 0, r, r)) if mixing.halo is None else mixing.halo(x, r)
        valid = mixing.valid.to(x.dtype)
        out = None
        for j in range(2 * r + 1):
            term = xp[:, j : j + n] * valid[j, :, :, None] * self.weight[j].to(x.dtype)
            out = term if out is None else out + term
        return out


class LocalMixing(NamedTuple):
    """What every :class:`LocalMixer` of one forward pass shares: ``valid [2r + 1, B, n]`` bool
    (:func:`local_mixer_valid`, this rank's slice) and ``halo(x, r) -> [B, n + 2r, D]`` (None:
    zero padding; sequence parallel: the neighbouring ranks' rows)."""

    valid: torch.Tensor
    halo: Callable[[torch.Tensor, int], torch.Tensor] | None = None


def local_mixer_valid(
    radius: int,
    n: int,
    batch: int,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """``[2r + 1, B, n]`` bool: True where token ``i + o`` (``o = j - r``) may feed token ``i``:
    inside the row, not padding, and in the same document (a document starts at each row start
    and at every unmasked position 0 of ``position_ids``)."""
    seg = None
    if position_ids is not None:
        seg = torch.cumsum(document_starts(position_ids, attention_mask).long(), dim=1)
    ok = (
        torch.ones(batch, n, dtype=torch.bool, device=device)
        if attention_mask is None
        else attention_mask.bool()
    )
    out = []
    for j in range(2 * radius + 1):
        o = j - radius
        v = torch.zeros(batch, n, dtype=torch.bool, device=device)
        lo, hi = max(0, -o), min(n, n - o)  # i in [lo, hi) has i + o in [0, n)
        if lo < hi:
            src = ok[:, lo + o : hi + o]
            if seg is not None:
                src = src & (seg[:, lo + o : hi + o] == seg[:, lo:hi])
            v[:, lo:hi] = src
        out.append(v)
    return torch.stack(out)


class EncoderLayer(nn.Module):
    """One transformer block; pre-LN or post-LN per ``config.norm``."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.pre_ln = config.norm == "pre"
        self.attention = LinformerSelfAttention(config, layer_idx)
        self.ffn = FeedForward(config)
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.dropout)
        self.mixer: LocalMixer | None = None
        self.ln_mix: nn.LayerNorm | None = None
        if config.local_mixer == "layers":
            self.mixer = LocalMixer(config.hidden_size, config.local_mixer_kernel)
            self.ln_mix = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        shared_projection: nn.Module | None = None,
        documents: Documents | None = None,
        mixing: LocalMixing | None = None,
        local: LocalContext | None = None,
    ) -> torch.Tensor:
        return self.ffn_block(
            self.attention_block(x, attention_mask, shared_projection, documents, mixing, local)
        )

    def attention_block(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        shared_projection: nn.Module | None = None,
        documents: Documents | None = None,
        mixing: LocalMixing | None = None,
        local: LocalContext | None = None,
    ) -> torch.Tensor:
        """The attention sub-layer with its residual and LayerNorm: ``[B, n, D] -> [B, n, D]``
        (``local_mixer: layers``: the mixing sub-layer first, with its own)."""
        args = (attention_mask, shared_projection, documents, local)
        if self.mixer is not None:
            if mixing is None:
                raise ValueError("a layer with a local mixer needs `mixing` (local_mixing)")
            if self.pre_ln:
                x = x + self.drop(self.mixer(self.ln_mix(x), mixing))
            else:
                x = self.ln_mix(x + self.drop(self.mixer(x, mixing)))
        if self.pre_ln:
            return x + self.drop(self.attention(self.ln1(x), *args))
        return self.ln1(x + self.drop(self.attention(x, *args)))

    def ffn_block(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward sub-layer with its residual and LayerNorm: ``[B, n, D] -> [B, n, D]``."""
        if self.pre_ln:
            return x + self.drop(self.ffn(self.ln2(x)))
        return self.ln2(x + self.drop(self.ffn(x)))
