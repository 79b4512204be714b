"""Reference drafter token choice (torch): full logits matmul, then argmax or inverse-CDF sampling."""

from __future__ import annotations

import torch

from .acceptance import check_row, filtered_probs, sample_inverse_cdf


def denoise_block(hidden, lm_head, *, temperature=0.0, top_k=0, top_p=1.0, uniforms=None):
    """hidden (T, H), lm_head (V, H) -> one token per row (T,) int64.

    temperature == 0: argmax of hidden @ lm_head^T (first index on ties; NaN logits raise).
    temperature > 0: token = inverse CDF of the filtered softmax at uniforms[t].
    """
    logits = hidden @ lm_head.to(hidden.dtype).T  # (T, V)
    tokens = torch.empty(hidden.shape[0], dtype=torch.int64)
    for t in range(hidden.shape[0]):
        if temperature == 0:
            if torch.isnan(logits[t]).any():
                raise ValueError(f"logits row {t} contains NaN (hidden or lm_head not finite)")
            tokens[t] = torch.argmax(logits[t])
            continue
        check_row(logits[t], f"logits row {t}")
        p = filtered_probs(logits[t], temperature, top_k, top_p)
        tokens[t] = sample_inverse_cdf(p, float(uniforms[t]))
    return tokens


def make_draft_block(anchor_ids, mask_token_id: int, block_size: int):
    """anchor_ids (B,) -> (B, block_size) rows [anchor, MASK, ..., MASK]."""
    block = torch.full((anchor_ids.shape[0], block_size), mask_token_id, dtype=torch.int64)
    block[:, 0] = anchor_ids
    return block
