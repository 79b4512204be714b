"""Reference speculative acceptance (torch): plain per-row loops, the oracle for the kernels.

Sampling rules shared with the kernels (docs in dflash_kernels/acceptance.py):
- filtered distribution of a logits row z: s = z / temperature; top-k keeps z >= the k-th largest z
  (ties at the threshold are all kept); top-p keeps p >= p*, p* the smallest probability of the
  shortest descending prefix whose mass reaches top_p (ties at p* all kept); renormalise.
- inverse CDF: with weights w and a uniform u, the first index whose running sum (index order)
  exceeds u * sum(w); if rounding leaves none, the last index with w > 0.
"""

from __future__ import annotations

import torch


def check_row(row: torch.Tensor, name: str, allow_posinf: bool = False) -> None:
    """The NaN / inf policy of a processed logits row (raises ValueError naming `name`)."""
    if torch.isnan(row).any():
        raise ValueError(f"{name} contains NaN")
    if not allow_posinf and torch.isposinf(row).any():
        raise ValueError(f"{name} contains +inf")
    if torch.isneginf(row).all():
        raise ValueError(f"{name} has no finite logit (all -inf)")


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(logits / temperature) after top-k and top-p filtering, in the dtype of `logits`. (V,)"""
    v = logits.shape[-1]
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < top_k < v:
        kth = torch.topk(logits, top_k).values[-1]
        keep = logits >= kth
    s = torch.where(keep, logits / temperature, torch.full_like(logits, float("-inf")))
    p = torch.softmax(s, dim=-1)
    if top_p < 1.0:
        desc = torch.sort(p, descending=True).values
        mass = torch.cumsum(desc, 0)
        reached = torch.nonzero(mass >= top_p)
        last = int(reached[0]) if len(reached) else int(torch.count_nonzero(desc)) - 1
        p = torch.where(p >= desc[last], p, torch.zeros_like(p))
        p = p / p.sum()
    return p


def sample_inverse_cdf(weights: torch.Tensor, u: float) -> int:
    """First index whose running sum exceeds u * sum(weights); the last positive weight if none."""
    csum = torch.cumsum(weights, 0)
    hit = torch.nonzero(csum > u * csum[-1])
    if len(hit):
        return int(hit[0])
    return int(torch.nonzero(weights > 0)[-1])


def accept_greedy(draft_tokens, target_tokens, num_draft):
    """drafts (B, K), target choices (B, K+1), num_draft (B,) -> (num_accepted (B,), out (B, K+1))."""
    b_sz, k = draft_tokens.shape
    num_accepted = torch.zeros(b_sz, dtype=torch.int64)
    out = torch.full((b_sz, k + 1), -1, dtype=torch.int64)
    for b in range(b_sz):
        n = int(num_draft[b])
        a = 0
        while a < n and int(draft_tokens[b, a]) == int(target_tokens[b, a]):
            out[b, a] = draft_tokens[b, a]
            a += 1
        out[b, a] = target_tokens[b, a]  # correction at the first mismatch, or the bonus token
        num_accepted[b] = a
    return num_accepted, out


def rejection_sample(draft_tokens, target_logits, draft_probs, num_draft, *, uniforms,
                     temperature=1.0, top_k=0, top_p=1.0):
    """Lossless speculative sampling, row by row; stops at the first rejection.

    draft_tokens (B, K), target_logits (B, K+1, V), draft_probs (B, K, V) or None (one-hot drafts),
    num_draft (B,), uniforms (B, K+1, 2): [..., 0] decides acceptance, [..., 1] draws the
    replacement / bonus token. Returns (num_accepted (B,), out_tokens (B, K+1), -1 padded).
    """
    uniforms = torch.as_tensor(uniforms, dtype=torch.float64)
    b_sz, k = draft_tokens.shape
    num_accepted = torch.zeros(b_sz, dtype=torch.int64)
    out = torch.full((b_sz, k + 1), -1, dtype=torch.int64)
    for b in range(b_sz):
        n = int(num_draft[b])
        for i in range(n + 1):
            row = target_logits[b, i]
            check_row(row, f"target_logits[{b}, {i}]", allow_posinf=temperature == 0)
            x = int(draft_tokens[b, i]) if i < n else -1
            if temperature == 0:  # p = one-hot(argmax): accept iff the draft is the argmax
                best = int(torch.argmax(row))
                if x == best:
                    out[b, i] = x
                    continue
                out[b, i] = best
                break
            p = filtered_probs(row, temperature, top_k, top_p)
            if i == n:  # every draft accepted: bonus token from row n
                out[b, i] = sample_inverse_cdf(p, float(uniforms[b, i, 1]))
                break
            u = float(uniforms[b, i, 0])
            if draft_probs is None:
                accept = u < float(p[x])
                residual = p.clone()
                residual[x] = 0.0  # max(0, p - onehot(x))
            else:
                q = draft_probs[b, i].to(p.dtype)
                accept = u * float(q[x]) < float(p[x])
                residual = torch.clamp(p - q, min=0.0)
            if accept:
                out[b, i] = x
                continue
            if not float(residual.sum()) > 0.0:
                residual = p  # residual all zero: fall back to p
            out[b, i] = sample_inverse_cdf(residual, float(uniforms[b, i, 1]))
            break
        num_accepted[b] = int((out[b] >= 0).sum()) - 1
    return num_accepted, out


def sample_filtered(logits, *, uniforms, temperature=1.0, top_k=0, top_p=1.0):
    """logits (T, V) -> (tokens (T,), probs (T, V)): each row's filtered distribution (one-hot argmax
    at temperature 0) and a draw from it by inverse CDF at uniforms[t] (uniforms None: tokens -1,
    except the argmax at temperature 0)."""
    tokens = torch.full((logits.shape[0],), -1, dtype=torch.int64)
    probs = torch.zeros_like(logits)
    for t in range(logits.shape[0]):
        row = logits[t]
        check_row(row, f"logits row {t}", allow_posinf=temperature == 0)
        if temperature == 0:
            tokens[t] = torch.argmax(row)
            probs[t, tokens[t]] = 1.0
            continue
        probs[t] = filtered_probs(row, temperature, top_k, top_p)
        if uniforms is not None:
            tokens[t] = sample_inverse_cdf(probs[t], float(uniforms[t]))
    return tokens, probs
