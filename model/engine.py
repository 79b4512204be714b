"""Speculative decoding engine: DFlash drafter + Qwen3 target, or plain autoregressive decoding.

    engine = dflash_kernels.model.load("Qwen3-8B", "Qwen3-8B-DFlash-b16")
    res = engine.generate("Hello", max_new_tokens=64)          # greedy, k chosen every round ("auto")
    res.token_ids, res.text, res.metrics.tau

The loop is docs/dflash.md section 3 for a batch of one; both the AR and the speculative paths go
through the same kernels and the same target-choice rule, so greedy outputs are identical and
sampled outputs have the same distribution.
"""

from __future__ import annotations

import copy
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import numpy as np

import dflash_kernels as dk
from dflash_kernels.acceptance import MIN_TEMPERATURE
from dflash_kernels.runtime import PRECISIONS

from ._ops import Ops
from .adaptive import AutoK, RoundCost
from .config import load_dflash_config, qwen3_config_from_dict
from .draft_vocab import FILE as draft_vocab_file, read as read_draft_vocab
from .drafter import DFlashDrafter
from .gguf import is_gguf, read_gguf
from .metrics import Metrics, aggregate
from .qwen3 import Qwen3Model
from .qwen35 import Qwen35Model
from .qwen35_config import Qwen35Config, load_target_config
from .tokenizer import Tokenizer, chat_template_of, render_chat, stop_token_ids
from .weights import check_finite, read_checkpoint

_EMPTY_DRAFTS = np.zeros((1, 0), np.int64)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


@dataclass
class GenerationResult:
    token_ids: list  # generated ids (a stop token that ended generation is included)
    text: str | None  # decoded generated text without the final stop token (None without tokenizer)
    finish_reason: str  # "stop" (stop token / string), "length" (max_new_tokens), "max_len" (cache full)
    metrics: Metrics
    prompt_ids: list


class Engine:
    """A loaded target (+ optional drafter); ``generate`` runs one sequence at a time (the KV caches
    are preallocated once and reused, so one Engine must not be used from two threads at once)."""

    def __init__(self, target: Qwen3Model, drafter: DFlashDrafter | None, tokenizer: Tokenizer | None,
                 stop_ids, *, ops: Ops, max_len: int, kv_dtype: str = "float32"):
        self.target, self.drafter, self.tokenizer, self.ops = target, drafter, tokenizer, ops
        self.stop_ids = tuple(int(i) for i in stop_ids)
        self.max_len, self.kv_dtype = max_len, kv_dtype
        self.history: list[Metrics] = []  # every call's metrics, for aggregate_metrics()
        self.target_dir = self.drafter_dir = None  # set by load()
        self.chat_template = None  # the target's Jinja chat template (None: ChatML), set by load()
        self._cache = None
        self._ctx = None
        # num_speculative_tokens="auto": the round cost on this machine and where the last request's
        # choice ended, kept across calls (model/adaptive.py). Acceptance is learnt per request: a
        # prior carried over from the last request starved the deep positions of trials (k settled
        # at 3 where 15 paid best).
        self.round_cost = RoundCost(self.default_num_speculative_tokens)
        self._tuned_k = None  # default_speculative_tokens(), looked up on first use
        # generate() is not re-entrant: the caches and the decoding state are the Engine's own
        self._busy = threading.Lock()

    # -- helpers for a CLI ---------------------------------------------------------------------

    @property
    def block_size(self) -> int | None:
        return self.drafter.cfg.block_size if self.drafter else None

    @property
    def default_num_speculative_tokens(self) -> int:
        return self.drafter.cfg.block_size - 1 if self.drafter else 0

    def default_speculative_tokens(self, temperature: float = 0.0, seed=None) -> int | str:
        """What generate drafts when num_speculative_tokens is not given: the k `dflash tune` stored for
        this pair and setting on this machine (read once per Engine; run_tune refreshes it), else
        "auto", except when sampling with a seed: block_size - 1; 0 without a drafter.

        Why not "auto" when sampling with a seed: its k follows measured round times, and sampled
        tokens depend on the drafts, so the seed would no longer reproduce the tokens (greedy output
        is the same for every k, and unseeded sampling has nothing to reproduce, so there "auto" only
        changes the speed: on SmolLM2 at T = 0.7 (AMD Zen 2), k = 15 ran at 0.43x autoregressive
        and auto at 1.08x, docs/benchmarks.md session 13)."""
        if self.drafter is None:
            return 0
        if self._tuned_k is None:
            from .benchmark import tuned_num_speculative_tokens

            tuned = tuned_num_speculative_tokens(self)
            self._tuned_k = -1 if tuned is None else min(tuned, self.default_num_speculative_tokens)
        if self._tuned_k >= 0:
            return self._tuned_k
        return "auto" if temperature == 0.0 or seed is None else self.default_num_speculative_tokens

    def chat_prompt(self, messages, enable_thinking: bool = False) -> str:
        """Prompt text through the target's own chat template (ChatML when it has none); thinking
        disabled by default (Qwen3 drafters were trained without it)."""
        return render_chat(messages, enable_thinking=enable_thinking, template=self.chat_template)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json: pass token ids instead of text")
        return self.tokenizer.encode(text)

    def clone(self, n_threads: int | None = None) -> Engine:
        """Another Engine over the same weights, for serving several threads (one Engine per thread:
        ``generate`` refuses concurrent use of one). The weights are shared and read-only (memory-mapped
        or packed once); the clone owns its caches, its decoding state, its metrics and its kernel
        settings (n_threads: default this Engine's). Cost: the KV caches, allocated on first use."""
        ops = Ops(n_threads=self.ops.n_threads if n_threads is None else n_threads, backend=self.ops.backend,
                  precision=self.ops.precision)
        target = copy.copy(self.target)
        target.ops = ops
        drafter = None
        if self.drafter is not None:
            drafter = copy.copy(self.drafter)
            drafter.ops = ops if self.drafter.ops is self.ops else ops.with_precision(self.drafter.ops.precision)
        twin = Engine(target, drafter, self.tokenizer, self.stop_ids, ops=ops, max_len=self.max_len,
                      kv_dtype=self.kv_dtype)
        twin.target_dir, twin.drafter_dir, twin.chat_template = self.target_dir, self.drafter_dir, self.chat_template
        return twin

    def kernel_seconds(self) -> float:
        """Wall time inside kernel calls so far, the target's and the drafter's (own ops at another
        precision, load's draft_precision)."""
        s = self.ops.kernel_s
        if self.drafter is not None and self.drafter.ops is not self.ops:
            s += self.drafter.ops.kernel_s
        return s

    def aggregate_metrics(self) -> Metrics:
        return aggregate(self.history)

    def reset_metrics(self) -> None:
        self.history.clear()

    # -- generation ----------------------------------------------------------------------------

    def _caches(self):
        if self._cache is None:
            self._cache = self.target.new_cache(self.max_len, self.kv_dtype)
            if self.drafter is not None:
                self._ctx = self.drafter.new_cache(self.max_len)
        self._cache.reset()
        if self._ctx is not None:
            self._ctx.reset()
        return self._cache, self._ctx

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        else:
            try:
                arr = np.asarray(prompt)
                if arr.size and arr.dtype.kind not in "iu":
                    raise TypeError
                ids = [int(i) for i in arr.astype(np.int64).reshape(-1)]
            except (TypeError, ValueError):
                raise TypeError(f"prompt must be a str or a sequence of token ids, "
                                f"got {type(prompt).__name__}") from None
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        V = self.target.cfg.vocab_size
        bad = [i for i in ids if not 0 <= i < V]
        if bad:
            raise ValueError(f"prompt token ids must lie in [0, {V}), got {bad[:5]}")
        if len(ids) >= self.max_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the KV cache holds max_len = {self.max_len} "
                             f"(load(..., max_len=) larger, up to max_position_embeddings)")
        return ids

    def generate(self, prompt_or_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed=None, num_speculative_tokens: int | str | None = None, stop=None,
                 stream=None, ignore_eos: bool = False) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after a prompt (text, encoded without chat
        template, or token ids).

        temperature 0 (or below dflash_kernels.acceptance.MIN_TEMPERATURE, 1e-6): greedy (identical
        with and without the drafter). temperature > 0: sampled
        with top_k (0 = off) / top_p (1 = off), lossless rejection sampling; ``seed`` (int) makes it
        reproducible. num_speculative_tokens: drafts per round (at most block_size - 1); 0 or no
        drafter = autoregressive; "auto" = chosen every round, 0 included, for the most expected
        tokens per second from this request's acceptance and this machine's measured round cost
        (model/adaptive.py). Default: the k `dflash tune` stored for this pair, threads, ISA tier
        and precision on this machine (0 when no k beat autoregressive decoding there), else "auto"
        when greedy or sampling without a seed, and block_size - 1 when sampling with one (so that
        the seed reproduces the tokens)
        (model/adaptive.py; the output does not depend on it). stop: extra stop token ids and/or
        stop strings (in addition to the checkpoint's eos ids unless ignore_eos). stream:
        ``callback(new_ids, new_text)`` after every round (new_text None without tokenizer).
        """
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise ValueError(f"seed must be an int >= 0 or None, got {seed!r}")
        if stream is not None and not callable(stream):
            raise TypeError(f"stream must be a callable(new_ids, new_text) or None, got {stream!r}")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("Engine.generate is already running, in another thread or further up this "
                               "one's stack (a stream callback): one Engine serves one generation at a "
                               "time; load one Engine per thread (the weights are memory-mapped and shared)")
        try:
            return self._generate(prompt_or_ids, max_new_tokens, temperature, top_k, top_p, seed,
                                  num_speculative_tokens, stop, stream, ignore_eos)
        finally:
            self._busy.release()

    def _generate(self, prompt_or_ids, max_new_tokens, temperature, top_k, top_p, seed, num_speculative_tokens,
                  stop, stream, ignore_eos) -> GenerationResult:
        if not _is_int(max_new_tokens) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not np.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if not _is_int(top_k) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
        if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")
        if temperature < MIN_TEMPERATURE:  # too small to invert: greedy, as every kernel treats it
            temperature = 0.0
        k = num_speculative_tokens
        if k is None:
            k = self.default_speculative_tokens(temperature, seed)
        auto = isinstance(k, str) and k == "auto"
        if auto:
            k = self.default_num_speculative_tokens  # the most a round may draft (0 without a drafter)
        elif not _is_int(k) or k < 0:
            raise ValueError(f"num_speculative_tokens must be an int >= 0 or 'auto', got {num_speculative_tokens!r}")
        if k > 0 and self.drafter is None:
            raise ValueError("num_speculative_tokens > 0 needs a drafter (load(target, drafter_dir))")
        if self.drafter is not None and k > self.drafter.cfg.block_size - 1:
            raise ValueError(f"num_speculative_tokens {k} exceeds the drafter's block_size - 1 = "
                             f"{self.drafter.cfg.block_size - 1}")
        stop_ids, stop_strings = self._stops(stop, ignore_eos)
        ids = self._prompt_ids(prompt_or_ids)
        metrics = Metrics(prompt_tokens=len(ids))
        if max_new_tokens == 0:
            self.history.append(metrics)
            return GenerationResult([], "" if self.tokenizer else None, "length", metrics, ids)
        run = _Run(self, int(max_new_tokens), float(temperature), int(top_k), float(top_p), seed,
                   stop_ids, stop_strings, stream, metrics)
        run.execute(ids, int(k), auto=auto and k > 0)
        self.history.append(metrics)
        out = run.out
        text = None
        if self.tokenizer is not None:
            body = out[:-1] if run.finish == "stop" and out and out[-1] in stop_ids else out
            text = self.tokenizer.decode(body)
            if run.finish == "stop" and stop_strings:
                cut = min((text.find(s) for s in stop_strings if s in text), default=-1)
                if cut >= 0:
                    text = text[:cut]
        return GenerationResult(out, text, run.finish, metrics, ids)

    def _stops(self, stop, ignore_eos):
        ids = set() if ignore_eos else set(self.stop_ids)
        strings = []
        if isinstance(stop, (bytes, bytearray)):  # list(b"\n") would silently be stop id 10
            raise TypeError(f"stop must be token ids and/or strings, got bytes {stop!r}: pass stop={stop.decode()!r}"
                            if isinstance(stop, bytes) and stop.isascii() else f"stop must be token ids and/or "
                            f"strings, got {type(stop).__name__}")
        if stop is not None and not isinstance(stop, (str, int, np.integer, list, tuple, set, frozenset)):
            raise TypeError(f"stop must be a token id, a string, or a list of them, got {stop!r}")
        for s in ([] if stop is None else ([stop] if isinstance(stop, (str, int, np.integer)) else list(stop))):
            if isinstance(s, str):
                if not s:
                    raise ValueError("stop strings must be non-empty")
                if self.tokenizer is None:
                    raise ValueError("stop strings need a tokenizer; pass stop token ids")
                strings.append(s)
            elif isinstance(s, (int, np.integer)) and not isinstance(s, bool):
                ids.add(int(s))
            else:
                raise TypeError(f"stop entries must be token ids or strings, got {s!r}")
        return frozenset(ids), tuple(strings)


class _Run:
    """State of one generate() call."""

    def __init__(self, eng: Engine, max_new, temperature, top_k, top_p, seed, stop_ids, stop_strings, stream,
                 metrics: Metrics):
        self.eng, self.target, self.drafter, self.ops = eng, eng.target, eng.drafter, eng.ops
        self.max_new, self.temperature, self.top_k, self.top_p = max_new, temperature, top_k, top_p
        self.rng = np.random.default_rng(seed) if temperature > 0 else None
        self.stop_ids, self.stop_strings, self.stream, self.m = stop_ids, stop_strings, stream, metrics
        self.out: list[int] = []
        self.finish = None
        self.decoder = eng.tokenizer.stream() if (stream is not None and eng.tokenizer is not None) else None
        self.callback_s = 0.0

    # target choice: the same rule for the first token, AR steps and (via the kernels) verification
    def _choose(self, hidden) -> int:
        if self.temperature == 0.0:
            return int(self.target.greedy(hidden)[0])
        logits = self.target.logits(hidden)  # (1, V)
        _, row = self.ops.rejection_sample(_EMPTY_DRAFTS, logits[None], self.temperature, self.top_k, self.top_p,
                                           self.rng)
        return int(np.asarray(row)[0, 0])

    def _commit(self, new) -> bool:
        """Append new tokens, honouring max_new_tokens and stops (scanning the new tokens only)."""
        n0 = len(self.out)
        for t in new:
            t = int(t)
            self.out.append(t)
            if t in self.stop_ids:
                self.finish = "stop"
                break
            if len(self.out) >= self.max_new:
                self.finish = "length"
                break
        if self.stop_strings and self.finish != "stop":
            self._check_stop_strings(n0)
        if self.stream is not None:
            t = perf_counter()
            new_ids = self.out[n0:]
            # the stop token that ends generation is not text (GenerationResult.text leaves it out too)
            stopped = self.finish == "stop" and new_ids and new_ids[-1] in self.stop_ids
            text = self.decoder.push(new_ids[:-1] if stopped else new_ids) if self.decoder else None
            if self.finish is not None and self.decoder:
                text += self.decoder.flush()
            self.stream(new_ids, text)
            self.callback_s += perf_counter() - t
        return self.finish is not None

    def _check_stop_strings(self, n0: int) -> None:
        tok = self.eng.tokenizer
        longest = max(len(s) for s in self.stop_strings)
        for j in range(n0, len(self.out)):
            # only text that ends in the new tokens can complete a stop string
            tail = tok.decode(self.out[max(0, n0 - longest) : j + 1])
            if any(s in tail for s in self.stop_strings):
                del self.out[j + 1 :]
                self.finish = "stop"
                return

    def execute(self, ids: list[int], k: int, auto: bool = False) -> None:
        """Prefill, then rounds of k drafts (auto: the k of each round chosen by model/adaptive.py,
        at most k)."""
        m, ops, target, drafter = self.m, self.ops, self.target, self.drafter
        use_draft = k > 0
        # acceptance is learnt afresh per request (the prompt decides it); the cost is the Engine's
        chooser = AutoK(k, self.eng.round_cost, sampled=self.temperature > 0) if auto else None
        cache, ctx = self.eng._caches()
        # auto: taps not yet in the drafter's context (the prompt's, then those of autoregressive
        # steps), added in one GEMM when a round drafts; a request that never drafts never pays
        # for them. Bounded: past a prefill chunk of rows they go in at once.
        pending, pending_rows = [], 0

        def defer(taps):
            nonlocal pending_rows
            pending.append(taps)
            pending_rows += taps.shape[0]
            if pending_rows >= target.prefill_chunk:
                flush()

        def flush():
            nonlocal pending_rows
            if pending:
                drafter.add_context(pending[0] if len(pending) == 1 else np.concatenate(pending), ctx)
                pending.clear()
                pending_rows = 0

        t_start = perf_counter()
        ops.adapt_threads()
        # prefill; the drafter's context K/V for the prompt is built chunk by chunk (auto: deferred)
        on_taps = None
        if use_draft:
            on_taps = defer if auto else (lambda t: drafter.add_context(t, ctx))
        hidden, _ = target.forward(ids, cache, last_only=True, taps=use_draft, on_taps=on_taps)
        done = self._commit([self._choose(hidden)])
        callback0 = self.callback_s  # the user's stream callback is not our time
        m.prefill_s = perf_counter() - t_start - callback0
        kernel0 = self.eng.kernel_seconds()
        anchor = self.out[-1]
        while not done:
            ops.adapt_threads()  # default threads: fewer while other processes take the cores
            start = cache.length  # committed tokens with K/V; the anchor goes to position start
            room = cache.max_len - start
            if room <= 0:
                self.finish = "max_len"
                break
            want = chooser.choose() if auto else k
            kk = min(want, self.max_new - len(self.out) - 1, room - 1)
            if kk > 0:  # the drafter's context for the positions committed since the last round
                flush()
            t0 = perf_counter()
            callback_before = self.callback_s
            unverified = None  # a whole-block probe's drafts past kk (auto, greedy)
            if kk <= 0:  # autoregressive step (no drafter, auto's choice, or the last token of the budget)
                t1 = t0
                # with auto, drafting may resume: the drafter will need this position's context,
                # added in one batch when it does (one GEMM instead of a GEMV per step)
                hidden, taps = target.forward([anchor], cache, taps=auto)
                new = [self._choose(hidden)]  # the target's choice counts as verification time
                if auto:
                    defer(taps)
                t2 = perf_counter()
                a = 0
            else:
                q = None
                if self.temperature == 0.0:
                    if auto and chooser.whole_block:  # a probe: the whole block drafted, k verified
                        drafts = drafter.draft(anchor, max(kk, min(k, room - 1)), ctx)
                        drafts, unverified = drafts[:kk], drafts[kk:].tolist()
                    else:
                        drafts = drafter.draft(anchor, kk, ctx)  # (k,) argmax drafts
                else:  # drafts sampled from the drafter's q; rejection sampling gets q too
                    drafts, q = drafter.draft_sampled(anchor, kk, ctx, self.temperature, self.top_k, self.top_p,
                                                      self.rng)
                t1 = perf_counter()
                block = np.empty(kk + 1, np.int64)
                block[0], block[1:] = anchor, drafts
                hidden, taps = target.forward(block, cache, taps=True)  # rows start..start+k
                if self.temperature == 0.0:
                    choice = target.greedy(hidden)  # (k+1,) target argmax per row
                    t2 = perf_counter()
                    n_acc, row = ops.accept_greedy(drafts[None], choice[None])
                else:
                    logits = target.logits(hidden)  # (k+1, V)
                    t2 = perf_counter()
                    n_acc, row = ops.rejection_sample(drafts[None], logits[None], self.temperature, self.top_k,
                                                      self.top_p, self.rng, draft_probs=q[None])
                a = int(np.asarray(n_acc)[0])
                new = np.asarray(row)[0, : a + 1].tolist()  # accepted drafts + bonus
                cache.truncate(start + a + 1)
                drafter.add_context(taps[: a + 1], ctx)  # context for the committed positions
            m.accepted.append(a)
            m.drafted.append(max(kk, 0))
            done = self._commit(new)
            anchor = self.out[-1]
            t3 = perf_counter()
            seconds = t3 - t0 - (self.callback_s - callback_before)
            if auto:
                chooser.observe(max(kk, 0), a, seconds, new, unverified)
            elif self.temperature == 0.0 and len(m.accepted) > 1:
                # a greedy round of a fixed k times that k for "auto" too (the round cost is the
                # Engine's); the first after the prefill runs on cold caches
                self.eng.round_cost.observe(max(kk, 0), seconds)
            m.draft_s += t1 - t0
            m.verify_s += t2 - t1
            m.accept_s += t3 - t2
        if self.finish is None:
            self.finish = "length"
        m.kernel_s = self.eng.kernel_seconds() - kernel0
        m.accept_s -= self.callback_s - callback0
        m.generated_tokens = len(self.out)
        m.total_s = perf_counter() - t_start - self.callback_s


def load(target_dir, drafter_dir=None, *, max_len: int | None = None, kv_dtype: str = "float32",
         n_threads: int | None = None, backend: str = "auto", prefill_chunk: int = 512,
         fuse_weights="auto", precision: str | None = None, draft_precision: str | None = "auto",
         gguf_dtype: str = "blocks-int8", mmap: bool = True, check_weights: bool = False,
         draft_vocab: bool = True, draft_int8: bool | None = None) -> Engine:
    """Load a Qwen3, Llama or Qwen3.5 (hybrid Gated DeltaNet) target, and optionally a DFlash drafter.

    target_dir: a Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json), or a
    GGUF file (Llama / Qwen3), or a directory holding one .gguf and no config.json.
    max_len: KV cache positions (prompt + generated), default min(max_position_embeddings, 8192).
    kv_dtype: "float32" or "bfloat16" target KV cache storage. n_threads / backend: passed to every
    kernel. prefill_chunk: prompt rows per target forward. fuse_weights: True stacks each layer's
    [Wq; Wk; Wv] and [Wgate; Wup] into one in-RAM bf16 copy (fewer kernel calls), False keeps every
    weight memory-mapped, "auto" fuses checkpoints smaller than a quarter of physical RAM.
    precision: matmul precision of every linear layer and LM-head pass, "highest" (default), "high"
    or "medium" (dflash_kernels.set_matmul_precision). Target steps and verification rows both use
    it, so greedy DFlash output stays identical to greedy autoregressive output under each.
    draft_precision: the drafter's matmul precision. Drafts only propose tokens that the target
    verifies, so it changes speed and acceptance, never the output. "auto" (default): "medium" where
    a bf16 dot product runs it (dflash_kernels.bf16_dot_pays(): AMX, or vdpbf16ps on Zen 4), else
    the target's; None: the target's; or one of the three names.
    gguf_dtype: how a GGUF's quantized tensors run. "blocks-int8" (default): Q4_0 / Q4_1 / Q8_0 matmul
    weights (projections, embedding, LM head) stay in their blocks (5 / 8.5 bits a weight) and are
    multiplied as llama.cpp does (each activation row rounded to int8 per block of 32, integer dot
    products: several rows at the cost of about one, so DFlash verification and prefill are cheap;
    values within about 1% of the exact ones, the precision setting aside: docs/architecture.md);
    other quantized tensors in bf16. "blocks": the same blocks computed exactly as their float32
    expansion (dflash_kernels.quant). Or expanded at load: "bfloat16" (half float32's bytes) or
    "float32" (exact; parity with a float32 reference such as transformers).
    mmap: True maps the checkpoint files (no copy; but a file truncated while loaded makes the process
    fail with SIGBUS, as any memory-mapped reader does); False reads them into memory.
    check_weights: scan every tensor for NaN / infinity first (a WeightsError names the tensor).
    draft_int8: the drafter's matmul weights requantized to Q4_1 blocks at load and multiplied with int8
    activations (half the bytes a draft streams; drafts are only proposals, so the output does not
    change, only which drafts are accepted). None (default): when the target is a GGUF run with
    gguf_dtype "blocks-int8".
    draft_vocab: draft only over the tokens listed in the drafter directory's draft_vocab.json when
    there is one (model/draft_vocab.py: a cheaper drafter LM head; the output is the target's either way).
    Raises ConfigError / WeightsError / TokenizerError / ValueError naming the file and key.
    """
    target_dir = Path(target_dir)
    if kv_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"kv_dtype must be 'float32' or 'bfloat16', got {kv_dtype!r}")
    if fuse_weights not in (True, False, "auto"):
        raise ValueError(f"fuse_weights must be True, False or 'auto', got {fuse_weights!r}")
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be an int >= 1 (prompt rows per target forward), got {prefill_chunk!r}")
    gguf_int8 = False  # a GGUF target over its blocks times int8 activations: the drafter's default too
    if is_gguf(target_dir):
        gguf_int8 = gguf_dtype == "blocks-int8"
        ck = read_gguf(target_dir, gguf_dtype, mmap=mmap)
        tcfg = qwen3_config_from_dict(ck.config, f"{ck.path} (metadata)")
        tensors, origin = ck.tensors, ck.origin
        tokenizer = Tokenizer(ck.path, ck.tokenizer)
        stops, template = tuple(dict.fromkeys(ck.eos_token_ids + tcfg.eos_token_ids)), ck.chat_template
    else:
        tcfg = load_target_config(target_dir)  # Qwen3, Llama or Qwen3.5 (hybrid) by architecture
        tensors = origin = None
    if max_len is None:
        max_len = min(tcfg.max_position_embeddings, 8192)
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len must be an int >= 2, got {max_len!r}")
    if max_len > tcfg.max_position_embeddings:
        raise ValueError(f"max_len {max_len} exceeds the target's max_position_embeddings "
                         f"{tcfg.max_position_embeddings}")
    dcfg = None
    if drafter_dir is not None:
        drafter_dir = Path(drafter_dir)
        dcfg = load_dflash_config(drafter_dir, num_target_layers=tcfg.num_hidden_layers)
        _check_pair(tcfg, dcfg, drafter_dir)
    ops = Ops(n_threads=n_threads, backend=backend, precision=precision)
    if draft_precision == "auto":
        draft_precision = "medium" if dk.bf16_dot_pays() else ops.precision
    if draft_precision is None:
        draft_precision = ops.precision
    if not isinstance(draft_precision, str) or draft_precision not in PRECISIONS:
        raise ValueError(f"draft_precision must be 'auto', None or one of {', '.join(PRECISIONS)}, "
                         f"got {draft_precision!r}")
    draft_ops = ops if draft_precision == ops.precision else ops.with_precision(draft_precision)
    if tensors is None:
        tensors, origin = read_checkpoint(target_dir, mmap)
        has_tok = (target_dir / "tokenizer.json").exists()
        tokenizer = Tokenizer(target_dir / "tokenizer.json") if has_tok else None
        stops = stop_token_ids(target_dir, tcfg.eos_token_ids, tokenizer)
        template = chat_template_of(target_dir)
    if check_weights:
        check_finite(tensors, origin)
    fuse = fuse_weights
    if fuse == "auto":
        # Fusing saves 3 of 5 GEMV calls per layer (Qwen3-1.7B shape, 2 threads: AR step 132 vs
        # 142 ms) at the price of an in-RAM copy of those weights.
        fuse = sum(a.nbytes for a in tensors.values()) < _physical_ram_bytes() / 4
    target_cls = Qwen35Model if isinstance(tcfg, Qwen35Config) else Qwen3Model
    target = target_cls(tcfg, tensors, origin, ops=ops, prefill_chunk=prefill_chunk, fuse=fuse,
                        where=str(target_dir), tap_layer_ids=dcfg.target_layer_ids if dcfg else ())
    drafter = None
    if dcfg is not None:
        dtensors, dorigin = read_checkpoint(drafter_dir, mmap)
        if check_weights:
            check_finite(dtensors, dorigin)
        drafter = DFlashDrafter(dcfg, dtensors, target.embed, target.lm_head, origin=dorigin, ops=draft_ops,
                                target_hidden=tcfg.hidden_size, fuse=fuse, where=str(drafter_dir),
                                int8=gguf_int8 if draft_int8 is None else bool(draft_int8))
        vocab_file = drafter_dir / draft_vocab_file
        if draft_vocab and vocab_file.is_file():
            drafter.set_draft_vocab(read_draft_vocab(vocab_file, tcfg.vocab_size), target.lm_head_table)
    engine = Engine(target, drafter, tokenizer, stops, ops=ops, max_len=max_len, kv_dtype=kv_dtype)
    engine.target_dir, engine.drafter_dir, engine.chat_template = target_dir, drafter_dir, template
    return engine


def _physical_ram_bytes() -> float:
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # not POSIX: the old fixed threshold
        return float(8 << 30)


def _check_pair(t, d, drafter_dir) -> None:
    """Drafter/target mismatches that would otherwise run and silently produce garbage."""
    where = Path(drafter_dir) / "config.json"
    if d.hidden_size != t.hidden_size:
        raise ValueError(f"{where}: hidden_size {d.hidden_size} != target hidden_size {t.hidden_size} "
                         "(the drafter embeds with the target's embed_tokens)")
    if d.vocab_size is not None and d.vocab_size != t.vocab_size:
        raise ValueError(f"{where}: vocab_size {d.vocab_size} != target vocab_size {t.vocab_size}")
    bad = [i for i in d.target_layer_ids if i >= t.num_hidden_layers]
    if bad:
        raise ValueError(f"{where}: dflash_config.target_layer_ids {list(d.target_layer_ids)} has {bad} beyond "
                         f"the target's {t.num_hidden_layers} layers (0..{t.num_hidden_layers - 1})")
    if d.num_target_layers is not None and d.num_target_layers != t.num_hidden_layers:
        raise ValueError(f"{where}: num_target_layers {d.num_target_layers} != target num_hidden_layers "
                         f"{t.num_hidden_layers}: drafter trained for another target")
    if not 0 <= d.mask_token_id < t.vocab_size:
        raise ValueError(f"{where}: dflash_config.mask_token_id {d.mask_token_id} outside the target embedding "
                         f"(vocab_size {t.vocab_size})")
