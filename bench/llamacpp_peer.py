"""The llama.cpp peer: greedy decoding of the same prompts with llama-cpp-python, for the SmolLM2 comparison.

Runs in an environment that has ``llama-cpp-python`` (it builds llama.cpp from source, about 8 minutes on
2 cores); it needs nothing from this project. The prompts are rendered chat prompts in a JSON list (what
``python bench/llamacpp_peer.py --write-prompts FILE`` writes from this project's held-out chat prompts).

    python bench/llamacpp_peer.py --write-prompts prompts.json          # with dflash_kernels installed
    venv/bin/python bench/llamacpp_peer.py --gguf SmolLM2.Q4_1.gguf --bf16 smollm2-bf16.gguf \\
        --prompts prompts.json --threads 2 --max-new-tokens 128
    python bench/llamacpp_peer.py --ours --prompts prompts.json --threads 2 --max-new-tokens 128

--ours times this project's engine (SmolLM2 + its shipped drafter: autoregressive and DFlash at -k) on the
same prompts with the same rule, in the same process order.

--bf16 OUT requantizes the GGUF to BF16 with llama.cpp's own ``llama_model_quantize`` first (the
comparison the issue asks for is bf16 against bf16). Without it llama.cpp runs the file's own Q4_1 /
Q8_0 blocks, the comparison for ``--ours --gguf-dtype blocks`` (this project reading the same blocks).
Tokens/s counts generated tokens over the wall time of each call, prefill included, as the published
llama.cpp figure does; the median over prompts and the aggregate are printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def write_prompts(path: str, n: int) -> None:
    import dflash_kernels.model as dm

    eng = dm.load_default("smollm2", max_len=64)
    from dflash_kernels.model.prompts import chat_prompts

    Path(path).write_text(json.dumps([eng.chat_prompt(p) for p in chat_prompts("eval", n)]) + "\n")


def run_ours(prompts: list[str], threads: int, max_new: int, k, gguf_dtype: str = "blocks-int8") -> dict:
    import dflash_kernels.model as dm

    eng = dm.load_default("smollm2", n_threads=threads, gguf_dtype=gguf_dtype)
    eng.generate(prompts[0], 8)  # warm-up
    out = {}
    for label, kk in (("autoregressive", 0), ("dflash", k)):
        rates, total_tokens, total_s = [], 0, 0.0
        for p in prompts:
            t = time.perf_counter()
            res = eng.generate(p, max_new, num_speculative_tokens=kk)
            dt = time.perf_counter() - t
            rates.append(len(res.token_ids) / dt)
            total_tokens += len(res.token_ids)
            total_s += dt
        out[label] = {"median_tokens_per_second": statistics.median(rates), "tokens_per_second": total_tokens / total_s,
                      "tokens": total_tokens}
    return out


def quantize_bf16(src: str, dst: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_BF16
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-prompts", metavar="FILE")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--gguf")
    ap.add_argument("--bf16", metavar="OUT", help="requantize --gguf to BF16 here and run that")
    ap.add_argument("--prompts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ours", action="store_true", help="time this project's engine instead of llama.cpp")
    ap.add_argument("-k", default="15", help="drafts per round for --ours (an int or 'auto')")
    ap.add_argument("--gguf-dtype", default="blocks-int8", choices=("blocks-int8", "blocks", "bfloat16", "float32"),
                    help="--ours: the GGUF's weights expanded, or its blocks read as stored (load's gguf_dtype)")
    args = ap.parse_args()
    if args.ours:
        k = args.k if args.k == "auto" else int(args.k)
        result = run_ours(json.loads(Path(args.prompts).read_text()), args.threads, args.max_new_tokens, k,
                          args.gguf_dtype)
        print(json.dumps({"threads": args.threads, "k": args.k, "gguf_dtype": args.gguf_dtype, **result}, indent=2))
        return 0
    if args.write_prompts:
        write_prompts(args.write_prompts, args.n_prompts)
        return 0
    from llama_cpp import Llama

    model = args.gguf
    if args.bf16:
        if not Path(args.bf16).exists():
            quantize_bf16(args.gguf, args.bf16)
        model = args.bf16
    llm = Llama(model_path=model, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=1024,
                verbose=False, seed=0)
    prompts = json.loads(Path(args.prompts).read_text())
    llm(prompts[0], max_tokens=8, temperature=0.0)  # warm-up
    rates, total_tokens, total_s = [], 0, 0.0
    for p in prompts:
        t = time.perf_counter()
        out = llm(p, max_tokens=args.max_new_tokens, temperature=0.0, top_k=1)
        dt = time.perf_counter() - t
        n = out["usage"]["completion_tokens"]
        rates.append(n / dt)
        total_tokens += n
        total_s += dt
    print(json.dumps({"model": Path(model).name, "threads": args.threads, "prompts": len(prompts),
                      "median_tokens_per_second": statistics.median(rates),
                      "tokens_per_second": total_tokens / total_s, "tokens": total_tokens}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
