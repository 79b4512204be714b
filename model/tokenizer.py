"""tokenizer.json loading (``tokenizers`` only), streaming detokenizer, ChatML prompts, stop ids."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from .config import load_generation_config


class TokenizerError(ValueError):
    """A tokenizer.json that cannot be read."""


class Tokenizer:
    """Byte-level BPE tokenizer of a Qwen checkpoint (docs/models.md 3.4). No BOS is ever added."""

    def __init__(self, path, tokenizer=None):
        """path: a tokenizer.json; or tokenizer: a ready ``tokenizers.Tokenizer`` (a GGUF's), with
        path naming where it came from."""
        from tokenizers import Tokenizer as _HFTokenizer

        self.path = Path(path)
        if tokenizer is not None:
            self._tok = tokenizer
            return
        try:
            self._tok = _HFTokenizer.from_file(str(self.path))
        except Exception as err:  # missing file, bad JSON, unknown model type: all reported alike
            raise TokenizerError(f"{self.path}: cannot load tokenizer ({err})") from None

    @property
    def vocab_size(self) -> int:
        """Tokenizer ids incl. added tokens (smaller than the padded embedding; size tensors from config)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def stream(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Incremental detokenizer: feed ids, get the newly completed text.

    Decodes the whole generated sequence and emits the new suffix, holding back a trailing
    "\\ufffd" (an incomplete UTF-8 sequence split across tokens) until later tokens complete it.
    The concatenation of everything emitted plus ``flush()`` equals ``decode(all ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already returned

    def push(self, ids) -> str:
        self.ids.extend(int(i) for i in ids)
        text = self.tokenizer.decode(self.ids, self.skip)
        end = len(text)
        while end > self.emitted and text[end - 1] == "\ufffd":
            end -= 1
        if end <= self.emitted:
            return ""
        new, self.emitted = text[self.emitted : end], end
        return new

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids, self.skip)
        new, self.emitted = text[self.emitted :], len(text)
        return new


def render_chat(messages, *, add_generation_prompt: bool = True, enable_thinking: bool = True,
                template: str | None = None, **variables) -> str:
    """The prompt text of a conversation.

    messages: a str (one user turn) or a list of {"role", "content"} dicts. template: the model's own
    Jinja chat template (tokenizer_config.json's ``chat_template``, or a GGUF's
    ``tokenizer.chat_template``), rendered in a sandbox as transformers renders it; ``variables``
    (bos_token, ...) are passed to it. Without a template: ChatML (docs/models.md 3.5), where
    enable_thinking=False gives the generation prompt an empty think block, as the official Qwen3
    template writes it (DFlash Qwen3 drafters were trained that way).
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content"), str):
            raise ValueError(f"messages: each entry needs role system/user/assistant and str content, got {m!r}")
    if template is not None:
        return _jinja(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                       enable_thinking=enable_thinking, **variables)
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
        if not enable_thinking:
            parts.append("<think>\n\n</think>\n\n")
    return "".join(parts)


@functools.lru_cache(maxsize=8)
def _jinja(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except TemplateError as err:
        raise TokenizerError(f"chat template does not parse: {err}") from None


def chat_template_of(model_dir) -> str | None:
    """tokenizer_config.json's chat_template (a string, or the "default" of a named list), if any."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.exists():
        return None
    try:
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise TokenizerError(f"{path}: not a JSON object ({err})") from None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{path}: chat_template must be a string, got {type(template).__name__}")
    return template


def stop_token_ids(model_dir, config_eos=(), tokenizer: Tokenizer | None = None) -> tuple[int, ...]:
    """generation_config.json eos ids (int or list) plus the config's eos; falls back to <|im_end|> /
    <|endoftext|> from the tokenizer when neither file names one."""
    ids = list(load_generation_config(model_dir).eos_token_ids)
    ids += [i for i in config_eos if i not in ids]
    if not ids and tokenizer is not None:
        for tok in ("<|im_end|>", "<|endoftext|>"):
            i = tokenizer.token_to_id(tok)
            if i is not None:
                ids.append(i)
    return tuple(ids)
