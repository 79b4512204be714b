"""Training the shipped pair on this CPU (docs/dflash.md section 7): tokenizer, Qwen3 target, DFlash drafter.

Commands (`dflash train-tokenizer | train-target | train-drafter`) write checkpoints in the public
layout (bf16 safetensors, config.json, generation_config.json, tokenizer.json), resumable from
`train_state.pt`, with a JSONL loss log and progress bars.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from .config import default_target_layer_ids
from .corpus import read_text, stdlib_files
from .torch_qwen3 import DFlashDrafter, Qwen3LM, block_loss_weights, cosine_lr

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The Qwen2/3 pre-tokenizer regex (docs/models.md 3.1): digits split one by one.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")


# ----------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(out_dir: str | Path, vocab_size: int = 4096, texts: list[str] | None = None) -> Path:
    """Byte-level BPE in the Qwen layout (NFC, Split(regex, isolated) + ByteLevel, no BOS)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS), special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True,
    )
    texts = texts if texts is not None else read_text(stdlib_files("train"))
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)  # ids after the BPE vocabulary, like Qwen's added tokens
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


# ------------------------------------------------------------------------------------------- saving
def _save_bf16(state: dict, path: Path, skip: tuple[str, ...] = ()) -> None:
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items() if k not in skip}
    save_file(tensors, str(path), metadata={"format": "pt"})


def target_config(vocab_size: int, eos_id: int, bos_id: int, **over) -> dict:
    cfg = dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False, attention_dropout=0.0,
        bos_token_id=bos_id, eos_token_id=eos_id, head_dim=64, hidden_act="silu", hidden_size=256,
        initializer_range=0.02, intermediate_size=768, max_position_embeddings=4096, max_window_layers=4,
        num_attention_heads=4, num_hidden_layers=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        rope_scaling=None, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=True,
        torch_dtype="bfloat16", use_cache=True, use_sliding_window=False, vocab_size=vocab_size,
    )
    cfg.update(over)
    return cfg


def save_target(model: Qwen3LM, out: Path, tokenizer_json: Path, stop_ids: list[int]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(model.cfg)
    skip = ("lm_head.weight",) if cfg.get("tie_word_embeddings") else ()
    _save_bf16(model.state_dict(), out / "model.safetensors", skip)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": stop_ids, "do_sample": False}, indent=2) + "\n")
    if Path(tokenizer_json).resolve() != (out / "tokenizer.json").resolve():
        (out / "tokenizer.json").write_bytes(Path(tokenizer_json).read_bytes())


def save_drafter(model: DFlashDrafter, out: Path, target_cfg: dict, taps: list[int], mask_id: int,
                 block_size: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    c = model.cfg
    cfg = dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", block_size=block_size,
        num_target_layers=target_cfg["num_hidden_layers"], num_hidden_layers=c["num_hidden_layers"],
        hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"], hidden_act="silu", rms_norm_eps=c["rms_norm_eps"],
        rope_theta=c["rope_theta"], rope_scaling=None, max_position_embeddings=target_cfg["max_position_embeddings"],
        layer_types=["full_attention"] * c["num_hidden_layers"], sliding_window=None, attention_bias=False,
        vocab_size=target_cfg["vocab_size"], tie_word_embeddings=False, torch_dtype="bfloat16",
        dflash_config={"mask_token_id": mask_id, "target_layer_ids": taps, "block_size": block_size},
    )
    _save_bf16(model.state_dict(), out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def default_taps(n_target_layers: int, n_draft_layers: int) -> list[int]:
    """The default tap rule (docs/dflash.md 6), clamped into range for tiny targets (L < 4)."""
    return [min(max(i, 0), n_target_layers - 1) for i in default_target_layer_ids(n_target_layers, n_draft_layers)]


# ------------------------------------------------------------------------------------------ helpers
def _log(path: Path, **row) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _resume(state_path: Path, log_path: Path, model, opt) -> int:
    """Load model + optimizer from the last saved state; drop log rows written after it."""
    if not state_path.exists():
        return 0
    st = torch.load(state_path)
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["opt"])
    if log_path.exists():
        rows = [line for line in log_path.read_text().splitlines() if json.loads(line)["step"] <= st["step"]]
        log_path.write_text("".join(r + "\n" for r in rows))
    return st["step"]


def _save_state(path: Path, model, opt, step: int, extra: dict | None = None) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, **(extra or {})}, tmp)
    tmp.replace(path)  # atomic: an interrupted save never loses the previous state


def encode_corpus(tokenizer_json: Path, split: str, eos_id: int) -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    ids: list[int] = []
    for enc in tok.encode_batch(read_text(stdlib_files(split)), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.int32)


# ------------------------------------------------------------------------------------------- target
def train_target(out_dir, tokenizer_json, *, steps=6000, batch=16, seq=256, lr=2e-3, seed=0,
                 config_overrides=None, resume=True, eval_every=500, threads=None, quiet=False) -> dict:
    """Next-token training on the stdlib (held-out modules excluded); returns final metrics."""
    from tokenizers import Tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    tok = Tokenizer.from_file(str(tokenizer_json))
    eos, bos = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    n_tok = tok.get_vocab_size()
    vocab = (n_tok + 1 + 63) // 64 * 64  # padded like Qwen's; row n_tok is the unused mask row
    cfg = target_config(vocab, eos_id=bos, bos_id=bos, **(config_overrides or {}))
    torch.manual_seed(seed)
    model = Qwen3LM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    state_path, log_path = out / "train_state.pt", out / "train_log.jsonl"
    step = _resume(state_path, log_path, model, opt) if resume else 0
    train_ids = torch.from_numpy(encode_corpus(tokenizer_json, "train", bos).astype(np.int64))
    eval_ids = torch.from_numpy(encode_corpus(tokenizer_json, "eval", bos).astype(np.int64))
    gen = torch.Generator().manual_seed(seed + step)

    def batch_of(data):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s: s + seq + 1] for s in starts])
        return x[:, :-1], x[:, 1:]

    def held_out_loss(n=8):
        model.eval()
        with torch.no_grad():
            losses = [F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten()).item()
                      for x, y in (batch_of(eval_ids) for _ in range(n))]
        model.train()
        return float(np.mean(losses))

    bar = tqdm(total=steps, initial=step, desc="train-target", disable=quiet)
    t0 = time.time()
    while step < steps:
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, steps, lr, warmup=min(200, steps // 10 + 1))
        x, y = batch_of(train_ids)
        loss = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        row = {"step": step, "loss": round(loss.item(), 4), "elapsed_s": round(time.time() - t0, 1)}
        if step % eval_every == 0 or step == steps:
            row["held_out_loss"] = round(held_out_loss(), 4)
            _save_state(state_path, model, opt, step)
        _log(log_path, **row)
    bar.close()
    final = {"held_out_loss": held_out_loss(16), "steps": step, "n_params": sum(p.numel() for p in model.parameters())}
    save_target(model, out, Path(tokenizer_json), stop_ids=[eos, bos])
    (out / "train_result.json").write_text(json.dumps(final, indent=2) + "\n")
    return final


def load_torch_target(target_dir) -> Qwen3LM:
    """The trained target as a trainable-layout torch module (fp32), for drafter data and training."""
    from safetensors.torch import load_file

    target_dir = Path(target_dir)
    cfg = json.loads((target_dir / "config.json").read_text())
    model = Qwen3LM(cfg)
    state = {k: v.float() for k, v in load_file(str(target_dir / "model.safetensors")).items()}
    if cfg.get("tie_word_embeddings"):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state)
    return model.eval()


# ------------------------------------------------------------------------------------------ drafter
@torch.no_grad()
def generate_drafter_data(target: Qwen3LM, prompts: list[torch.Tensor], new_tokens: int, batch: int = 32,
                          quiet: bool = False) -> list[torch.Tensor]:
    """The target's own greedy continuations (what the drafter must predict), batched with a KV cache."""
    out = []
    for i in tqdm(range(0, len(prompts), batch), desc="drafter data", disable=quiet):
        group = prompts[i: i + batch]
        x = torch.stack(group)  # equal-length prompts
        logits, _, cache = target(x)
        seqs = [x]
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new_tokens):
            seqs.append(nxt)
            logits, _, cache = target(nxt, cache=cache)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.extend(torch.cat(seqs, 1))
    return out


def _init_drafter(drafter, src: Path, taps: list[int]) -> None:
    """Load a saved drafter's weights (bf16 safetensors) into the trainable module, checking its taps."""
    from safetensors.torch import load_file

    cfg = json.loads((src / "config.json").read_text())
    src_taps = cfg.get("dflash_config", {}).get("target_layer_ids")
    if src_taps != taps:
        raise ValueError(f"{src / 'config.json'}: target_layer_ids {src_taps} != {taps} for this target")
    state = {k: v.float() for k, v in load_file(str(src / "model.safetensors")).items()}
    try:
        drafter.load_state_dict(state)  # strict: names missing, unexpected or of another shape
    except RuntimeError as err:
        raise ValueError(f"{src / 'model.safetensors'}: does not match the drafter: {err}") from None


def train_drafter(out_dir, target_dir, *, steps=3000, layers=1, block_size=16, batch=8, anchors=16,
                  prompt_len=64, new_tokens=192, n_sequences=2048, lr=6e-4, seed=0, resume=True,
                  threads=None, quiet=False, init_from=None, taps=None) -> dict:
    """DFlash drafter on the target's greedy continuations: random anchors, block mask, decayed loss.

    init_from: a drafter checkpoint directory to start from (fine-tuning); ignored when resuming.
    taps: target layer ids to read (default: the default rule, docs/dflash.md 6).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    target = load_torch_target(target_dir)
    for p in target.parameters():
        p.requires_grad_(False)
    tcfg = target.cfg
    n_layers_t = tcfg["num_hidden_layers"]
    if taps is None:
        taps = default_taps(n_layers_t, layers)
    taps = [int(i) for i in taps]
    if not taps or any(not 0 <= i < n_layers_t for i in taps):
        raise ValueError(f"taps must be target layer ids in [0, {n_layers_t}), got {taps}")
    mask_id = tcfg["vocab_size"] - 1  # an unused padded row of the embedding
    dcfg = {k: tcfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                  "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta")}
    dcfg["num_hidden_layers"] = layers
    torch.manual_seed(seed)
    drafter = DFlashDrafter(dcfg, n_taps=len(taps))
    data_path = out / "drafter_data.pt"
    if data_path.exists():
        seqs = torch.load(data_path)
    else:
        ids = encode_corpus(Path(target_dir) / "tokenizer.json", "train", tcfg["bos_token_id"])
        corpus = torch.from_numpy(ids.astype(np.int64))
        rnd = random.Random(seed)
        starts = (rnd.randrange(len(corpus) - prompt_len) for _ in range(n_sequences))
        prompts = [corpus[s: s + prompt_len] for s in starts]
        seqs = torch.stack(generate_drafter_data(target, prompts, new_tokens, quiet=quiet))
        torch.save(seqs, data_path)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)
    state_path, log_path = out / "train_state.pt", out / "train_log.jsonl"
    step = _resume(state_path, log_path, drafter, opt) if resume else 0
    if step == 0 and init_from is not None:
        _init_drafter(drafter, Path(init_from), taps)
    weights = block_loss_weights(block_size)
    embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
    n_eval = max(1, len(seqs) // 16)
    train_seqs, eval_seqs = seqs[n_eval:], seqs[:n_eval]
    gen = torch.Generator().manual_seed(seed + step)
    length = seqs.shape[1]

    def batch_loss(rows: torch.Tensor):
        with torch.no_grad():
            _, tapped, _ = target(rows, taps=taps)
        feats = torch.cat(tapped, -1)  # (B, L, n*H)
        # anchors inside the continuation so the block predicts the target's own output
        lo, hi = prompt_len - 1, length - block_size
        anc = torch.stack([torch.randperm(hi - lo, generator=gen)[:anchors] + lo for _ in range(rows.shape[0])])
        offs = torch.arange(block_size)
        pos = (anc[..., None] + offs).flatten(1)  # (B, N*Bk)
        ids = torch.full_like(pos, mask_id)
        ids.view(rows.shape[0], anchors, block_size)[..., 0] = torch.gather(rows, 1, anc)
        hidden = drafter(F.embedding(ids, embed), pos, feats, anc)
        labels = torch.gather(rows, 1, pos).view(rows.shape[0], anchors, block_size)[..., 1:]
        logits = F.linear(hidden.view(rows.shape[0], anchors, block_size, -1)[:, :, 1:], lm_head)
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
        acc = (logits.argmax(-1) == labels).float()
        return (ce * weights).sum() / (weights.sum() * ce.shape[0] * ce.shape[1]), acc

    def eval_metrics():
        drafter.eval()
        with torch.no_grad():
            loss, acc = batch_loss(eval_seqs[:64])
        drafter.train()
        # tau = tokens per round. Decoding visits an anchor once per round, so fast (long-accept)
        # stretches get few rounds: the estimate is the harmonic mean of (accepted prefix + 1) over
        # anchors, not the plain mean. On the shipped pair's own continuations: plain mean 6.6,
        # harmonic 3.2, decoding measured 4.1 (the harmonic mean is the conservative one).
        tau = float(1.0 / (1.0 / (acc.cumprod(-1).sum(-1) + 1)).mean())
        return float(loss), tau

    bar = tqdm(total=steps, initial=step, desc="train-drafter", disable=quiet)
    t0 = time.time()
    while step < steps:
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, steps, lr, warmup=min(100, steps // 10 + 1))
        idx = torch.randint(0, len(train_seqs), (batch,), generator=gen)
        loss, _ = batch_loss(train_seqs[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        row = {"step": step, "loss": round(loss.item(), 4), "elapsed_s": round(time.time() - t0, 1)}
        if step % 250 == 0 or step == steps:
            row["eval_loss"], row["eval_tau_estimate"] = (round(v, 4) for v in eval_metrics())
            _save_state(state_path, drafter, opt, step)
        _log(log_path, **row)
    bar.close()
    loss, tau = eval_metrics()
    final = {"eval_loss": loss, "eval_tau_estimate": tau, "steps": step, "taps": taps,
             "n_params": sum(p.numel() for p in drafter.parameters())}
    save_drafter(drafter, out, tcfg, taps, mask_id, block_size)
    (out / "train_result.json").write_text(json.dumps(final, indent=2) + "\n")
    return final
