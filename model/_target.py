"""What every target model (Qwen3, Qwen3.5) shares: DFlash taps, embedding rows, the LM head, and the
prefill / decode / verify conveniences over ``forward``."""

from __future__ import annotations

import numpy as np

from dflash_kernels.quant import QuantizedRows

from ._ops import Ops
from .weights import as_f32, check_tensors, storage


class TargetBase:
    """Needs ``forward(ids, cache, last_only=, taps=)``; ``_load_shared`` sets the rest."""

    def _load_shared(self, cfg, tensors: dict, origin: dict | None, shapes: dict, where: str, ops: Ops | None,
                     prefill_chunk: int, fuse: bool, prefix: str = "model."):
        """Check the tensors against ``shapes`` and set what every target holds: cfg, ops, eps,
        prefill_chunk, the embedding, the LM head and the final norm. Returns the tensors as
        storage arrays and the weight preparation (``ops.prepare`` when fusing: a packed copy where
        Cython runs; else identity, so unfused weights stay memory-mapped)."""
        check_tensors(tensors, origin or {}, shapes, where,
                      optional=("lm_head.weight",) if cfg.tie_word_embeddings else ())
        self.cfg = cfg
        self.ops = ops or Ops()
        self.eps = cfg.rms_norm_eps
        self.prefill_chunk = prefill_chunk
        t = {k: storage(v) for k, v in tensors.items()}
        self.embed = t[prefix + "embed_tokens.weight"]  # (V, H) bf16 or f32, memory-mapped
        # GGUF blocks run only packed (dk.pack_quantized): prepared even when nothing else is
        prep = self.ops.prepare if fuse else (lambda w: self.ops.prepare(w) if isinstance(w, QuantizedRows) else w)
        # the head as stored (memory-mapped where the file allows): rows of it for a drafting vocabulary
        self.lm_head_table = self.embed if cfg.tie_word_embeddings else t["lm_head.weight"]
        self.lm_head = prep(self.lm_head_table)  # (V, H)
        self.norm = as_f32(t[prefix + "norm.weight"])
        return t, prep

    @staticmethod
    def _forward_ids(ids, cache) -> np.ndarray:
        """ids as a flat int64 array of at least one token that fits in the cache."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        T = ids.shape[0]
        if T == 0:
            raise ValueError("forward needs at least one token")
        if cache.length + T > cache.max_len:
            raise ValueError(f"KV cache overflow: {cache.length} + {T} tokens > max_len {cache.max_len}")
        return ids

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

    def _write_taps(self, tap_out, layer: int, x, norm_offset: float = 0.0) -> None:
        """The residual stream x after ``layer`` into its tap columns (tap_out (T, n_taps * H)); HF's
        last hidden state is the final-normed one, so the last layer's tap is normed."""
        if layer == self.cfg.num_hidden_layers - 1:
            x = self.ops.rms_norm(x, self.norm, self.eps, offset=norm_offset)
        H = self.cfg.hidden_size
        for slot in self._tap_slot[layer]:
            tap_out[:, slot * H : (slot + 1) * H] = x

    @property
    def tap_width(self) -> int:
        return len(self.tap_ids) * self.cfg.hidden_size

    def _run_chunks(self, ids, chunk: int, last_only: bool, taps: bool, on_taps, forward_rows):
        """Run ``forward_rows(rows, tap_buf, want_hidden)`` over ``ids`` in chunks of ``chunk`` rows,
        collecting hidden rows (only the last one when last_only) and the taps (streamed to
        ``on_taps`` chunk by chunk when given, else returned whole)."""
        T = ids.shape[0]
        want_taps = taps and bool(self.tap_ids)
        tap_out = np.empty((T, self.tap_width), np.float32) if want_taps and on_taps is None else None
        hidden = []
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            if not want_taps:
                buf = None
            elif tap_out is not None:
                buf = tap_out[s:e]
            else:
                buf = np.empty((e - s, self.tap_width), np.float32)
            h = forward_rows(ids[s:e], buf, e == T or not last_only)
            if on_taps is not None and buf is not None:
                on_taps(buf)
            if h is not None:
                hidden.append(h[-1:] if last_only else h)
        return (hidden[0] if len(hidden) == 1 else np.concatenate(hidden)), tap_out

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
