"""A drafting vocabulary: the tokens a drafter may propose, a subset of the target's.

The drafter's token choice multiplies its hidden rows by the target's LM head: on SmolLM2-135M a
k = 2 round streams the whole 49152 x 576 head (57 MB in bf16) for two rows, about 2 of the
drafter's 3.4 ms; on the Qwen3-1.7B shape the head's 15 rows are 9.3 GFLOP, 13% of a k = 15
round. Drafts only decide what the target checks, so drafting over the tokens the target actually
writes (as EAGLE-3 drafts over 32k of Llama 3's 128k) keeps the output exactly the target's and
costs acceptance only where the target writes a token outside the set.

The set is measured, not guessed: the tokens the target generates on the training prompts
(greedy), plus the stop tokens, by this module's command below; or, when a drafter is trained over
its drafting vocabulary (``dflash train-drafter --draft-vocab measure``, model/training.py), the
tokens of its training data's continuations. It is stored beside the drafter as
``draft_vocab.json`` (a file other engines ignore); ``model.load`` uses it when present
(``draft_vocab=False`` turns it off).

    python -m dflash_kernels.model.draft_vocab --model smollm2 --n-prompts 200 --max-new-tokens 96 \\
        --out model/default/smollm2-drafter/draft_vocab.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

FILE = "draft_vocab.json"


def count_generated(eng, prompts: list[str], max_new_tokens: int, progress=None) -> np.ndarray:
    """How often the target writes each token id, greedily, continuing `prompts` (vocab,) int64."""
    counts = np.zeros(eng.target.cfg.vocab_size, np.int64)
    for i, p in enumerate(prompts):
        res = eng.generate(p, max_new_tokens)
        np.add.at(counts, np.asarray(res.token_ids, np.int64), 1)
        if progress is not None:
            progress(i + 1, len(prompts))
    return counts


def write(path, token_ids, *, vocab_size: int, source: str, tokens_counted: int) -> None:
    ids = sorted({int(t) for t in token_ids})
    Path(path).write_text(json.dumps({"vocab_size": vocab_size, "tokens_counted": tokens_counted,
                                      "source": source, "token_ids": ids}) + "\n", encoding="utf-8")


def read(path, vocab_size: int) -> np.ndarray:
    """The sorted, unique int64 token ids of a draft_vocab.json, checked against the target's vocabulary."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        ids = np.asarray(data["token_ids"], dtype=np.int64)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a draft vocabulary ({err})") from err
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"{path}: token_ids must be a non-empty list of ints")
    if data.get("vocab_size", vocab_size) != vocab_size:
        raise ValueError(f"{path}: made for a vocabulary of {data['vocab_size']}, the target has {vocab_size}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{path}: token ids must lie in [0, {vocab_size}), got {ids.min()}..{ids.max()}")
    return np.unique(ids)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="measure a drafting vocabulary: the tokens the target writes")
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "stdlib"))
    ap.add_argument("--n-prompts", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True, help="the draft_vocab.json to write")
    args = ap.parse_args(argv)

    from .defaults import load_default
    from .prompts import chat_prompts

    eng = load_default(args.model, n_threads=args.threads, draft_vocab=False)
    prompts = [eng.chat_prompt(p) for p in chat_prompts("train", args.n_prompts)]
    counts = count_generated(eng, prompts, args.max_new_tokens,
                             progress=lambda i, n: print(f"\r{i}/{n} prompts", end="", file=sys.stderr))
    print(file=sys.stderr)
    seen = np.flatnonzero(counts)
    ids = set(seen.tolist()) | set(eng.stop_ids)
    write(args.out, ids, vocab_size=len(counts), tokens_counted=int(counts.sum()),
          source=f"greedy continuations of {len(prompts)} train-split chat prompts (model/prompts.py), "
                 f"up to {args.max_new_tokens} tokens each, and the stop tokens")
    print(f"{args.out}: {len(ids)} of {len(counts)} tokens ({int(counts.sum())} generated tokens counted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
