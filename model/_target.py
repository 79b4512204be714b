"""What every target model (Qwen3, Qwen3.5) shares: DFlash taps, embedding rows, the LM head, and the
prefill / decode / verify conveniences over ``forward``."""

from __future__ import annotations

import numpy as np

from .weights import as_f32


class TargetBase:
    """Needs ``cfg``, ``ops``, ``embed``, ``lm_head`` and ``forward(ids, cache, last_only=, taps=)``."""

    def set_taps(self, tap_layer_ids) -> None:
        """Layers whose output residual stream is returned as DFlash context features, in order."""
        L = self.cfg.num_hidden_layers
        ids = tuple(int(i) for i in tap_layer_ids)
        bad = [i for i in ids if not 0 <= i < L]
        if bad:
            raise ValueError(f"target_layer_ids {list(ids)}: {bad} outside the target's {L} layers (0..{L - 1})")
        self.tap_ids = ids
        self._tap_slot = {}  # layer -> list of column slots
        for slot, layer in enumerate(ids):
            self._tap_slot.setdefault(layer, []).append(slot)

    @property
    def tap_width(self) -> int:
        return len(self.tap_ids) * self.cfg.hidden_size

    def embed_rows(self, ids: np.ndarray) -> np.ndarray:
        return as_f32(self.embed[ids])  # (T, H) float32 copy of the needed rows only

    def prefill(self, ids, cache):
        """Prompt -> (float32 logits (1, V) of the last position, taps (T, n_taps * H) or None)."""
        hidden, taps = self.forward(ids, cache, last_only=True)
        return self.logits(hidden), taps

    def decode(self, token: int, cache) -> np.ndarray:
        """One token at position cache.length -> float32 logits (1, V)."""
        hidden, _ = self.forward([token], cache, taps=False)
        return self.logits(hidden)

    def verify(self, tokens, cache):
        """[anchor, drafts...] (k+1 tokens) -> (float32 logits (k+1, V), taps (k+1, n_taps * H));
        cut rejected rows afterwards with ``cache.truncate(start + accepted + 1)``."""
        hidden, taps = self.forward(tokens, cache)
        return self.logits(hidden), taps

    def logits(self, hidden) -> np.ndarray:
        """(T, H) final-normed hidden -> (T, V) float32 logits."""
        return self.ops.linear(hidden, self.lm_head)

    def greedy(self, hidden) -> np.ndarray:
        """(T, H) final-normed hidden -> (T,) argmax token ids (first on ties), no logits materialised."""
        return self.ops.argmax_tokens(hidden, self.lm_head)
