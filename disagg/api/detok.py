"""Incremental detokenization for streamed responses: each token's text at a bounded cost.

Decoding the whole output on every token costs O(n) per token, O(n^2) per response (a 4K-token
answer decodes 8M tokens). Here only the last emitted piece's tokens (the context) and the new
ones are decoded:

    ids    | emitted ...           | context      | new          |
                                   ^prefix        ^read          ^len(ids)
    piece  = decode(ids[prefix:]) less its first len(decode(ids[prefix:read])) characters

The context lets decoders whose output depends on the token before (SentencePiece's leading
space, byte-level merges) decode the new tokens as the whole text would.

NOTES
1. A piece is held back while its bytes end inside a UTF-8 character: the tokenizer says so
   where it has ``incomplete_tail(ids)``; otherwise a trailing replacement character is held
   while it stands for fewer than ``MAX_HELD_TOKENS`` trailing tokens (a UTF-8 character is at
   most 4 bytes, so one standing for more is invalid bytes, e.g. a random model's output, and
   holding it longer would hold every later token back until the end of the stream). Without
   ``incomplete_tail`` the pieces add up to the whole text for valid UTF-8 output that has no
   U+FFFD of its own; invalid bytes, or a literal U+FFFD, right before a multi-byte character
   can make that character stream as a replacement character (the literal is indistinguishable
   from a held, incomplete one).
2. ``flush()`` emits whatever is held (the end of the stream), so the concatenated pieces are
   the text of all tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_HELD_TOKENS = 4


class IncrementalText:
    """The text of a growing token sequence, piece by piece."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # first token of the context window
        self._read = 0  # tokens whose text has been emitted
        self._incomplete = getattr(tokenizer, "incomplete_tail", None)

    def push(self, new_ids: Sequence[int]) -> str:
        """Add tokens; the new text they settle ("" while it is held, NOTE 1)."""
        self.ids.extend(new_ids)
        return self._piece(final=False)

    def flush(self) -> str:
        """The text still held (NOTE 2)."""
        return self._piece(final=True)

    def _piece(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        window = self.ids[self._prefix :]
        text = self.tokenizer.decode(window)
        context = self.tokenizer.decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        if not final:
            if self._incomplete is not None:
                held = self._incomplete(window)
            else:
                held = text.endswith("\ufffd") and self._waiting_on(window) < MAX_HELD_TOKENS
            if held or len(text) <= len(context):  # nothing new yet (or a token with no text)
                return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(context) :]

    def _waiting_on(self, window: list[int]) -> int:
        """How many trailing tokens of ``window`` its final replacement character stands for: the
        fewest whose removal leaves text that does not end in one (``MAX_HELD_TOKENS``: more than
        a UTF-8 character can still be waiting on, NOTE 1). Several tokens may arrive at once."""
        for k in range(1, min(MAX_HELD_TOKENS - 1, len(window)) + 1):
            if not self.tokenizer.decode(window[:-k]).endswith("\ufffd"):
                return k
        return MAX_HELD_TOKENS
