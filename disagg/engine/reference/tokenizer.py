"""Tokenizers: a byte-level default and an HF tokenizer when a model ships one.

ByteTokenizer ids::

    0 <pad>   1 <bos>   2 <eos>   3 <unk>   4 .. 259  UTF-8 bytes 0x00 .. 0xFF

Chat template (plain text, then encoded like any other text)::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n

NOTES
1. ``decode`` never raises: special ids are dropped (or rendered by name),
   ids outside the table become U+FFFD, and invalid UTF-8 is replaced.
"""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Any

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
BYTE_OFFSET = len(SPECIALS)


class ByteTokenizer:
    """UTF-8 bytes shifted past a few special ids; fits any vocab_size >= 260."""

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    unk_token_id = 3
    vocab_size = BYTE_OFFSET + 256

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out: list[str] = []
        buf = bytearray()

        def flush() -> None:
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()

        for i in ids:
            i = int(i)
            if BYTE_OFFSET <= i < self.vocab_size:
                buf.append(i - BYTE_OFFSET)
                continue
            flush()
            if 0 <= i < BYTE_OFFSET:
                if not skip_special_tokens:
                    out.append(SPECIALS[i])
            else:
                out.append("\ufffd")
        flush()
        return "".join(out)

    def incomplete_tail(self, ids) -> bool:
        """Whether the text of ``ids`` ends inside a UTF-8 character that more bytes could complete
        (a streaming server holds such a tail back; any other replacement character is final)."""
        tail = bytearray()
        for i in reversed(list(ids)[-4:]):
            i = int(i)
            if not BYTE_OFFSET <= i < self.vocab_size:
                break
            tail.insert(0, i - BYTE_OFFSET)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        decoder.decode(bytes(tail), final=False)
        return bool(decoder.getstate()[0])

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        return render_chat(messages, add_generation_prompt)


def render_chat(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """Role-tagged plain-text chat template shared by the fallback tokenizers."""
    parts = []
    for m in messages:
        role, content = m.get("role", "user"), m.get("content", "")
        if not isinstance(content, str):  # OpenAI-style content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|{role}|>\n{content}\n")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


class _TokenizersAdapter:
    """Gives a bare ``tokenizers.Tokenizer`` the small API the engine uses."""

    def __init__(self, tok, directory: Path):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        cfg = directory / "config.json"
        ids = {}
        if cfg.exists():
            import json

            ids = json.loads(cfg.read_text())
        self.bos_token_id = ids.get("bos_token_id")
        self.eos_token_id = ids.get("eos_token_id")
        self.pad_token_id = ids.get("pad_token_id")

    def _ids(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._ids(text)
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        return render_chat(messages, add_generation_prompt)


class _TransformersAdapter(_TokenizersAdapter):
    """Gives a ``transformers`` tokenizer ``ByteTokenizer``'s API: ``encode`` adds no special
    tokens unless asked, and ``apply_chat_template`` returns text (the model's own template
    where it ships one, else ``render_chat``), which the server then encodes."""

    def __init__(self, tok):  # its special ids come from the tokenizer, not config.json
        self._tok = tok
        self.vocab_size = len(tok)
        self.bos_token_id, self.eos_token_id, self.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id

    def _ids(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if getattr(self._tok, "chat_template", None):
            return self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False)
        return render_chat(messages, add_generation_prompt)


def load_tokenizer(model_dir: str | Path | None = None):
    """HF tokenizer from ``model_dir/tokenizer.json`` when one can be loaded, else ``ByteTokenizer``.

    With ``transformers`` it is its ``AutoTokenizer``, with only ``tokenizers`` a bare
    ``Tokenizer``; either is wrapped to ``ByteTokenizer``'s API.
    """
    if model_dir is None or not (Path(model_dir) / "tokenizer.json").exists():
        return ByteTokenizer()
    directory = Path(model_dir)
    try:
        from transformers import AutoTokenizer

        return _TransformersAdapter(AutoTokenizer.from_pretrained(str(directory)))
    except ImportError:
        pass
    try:
        from tokenizers import Tokenizer

        return _TokenizersAdapter(Tokenizer.from_file(str(directory / "tokenizer.json")), directory)
    except ImportError:
        return ByteTokenizer()
