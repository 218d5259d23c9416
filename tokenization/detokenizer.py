"""Incremental detokenization: token ids in, text deltas out, one instance per request.

Runs on: the orchestrator's detokenize stage (one thread per instance at a time).
Owns: the request's recent token window and what of it has been emitted.

The window trick (as in vLLM and SGLang): decode only tokens[prefix:] and emit the
part past the text of tokens[prefix:read], so decoders that depend on neighbours
(SentencePiece's stripped leading space) see context while the per-token cost stays
constant. Text is held back while the tail could still change:
  - byte-level BPE: while the tail bytes are an incomplete UTF-8 sequence;
  - byte fallback: while the last token is a `<0xXX>` byte token, because the
    decoder turns a whole run of byte tokens into U+FFFD if any byte in it is
    invalid, so the run's text is final only once a non-byte token ends it;
  - other decoders: while the decoded window ends in U+FFFD.
Special tokens are dropped before decoding when skipped, exactly like the decoder
does, so they never split or anchor the window.
Invariant: all deltas joined, plus flush(), equal tokenizer.decode(all ids).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from tokenization.byte_decoding import DecoderStyle
from tokenization.tokenizer import Tokenizer

# Prompt tokens kept as context for the first deltas (vLLM uses 5 as well).
PROMPT_CONTEXT_TOKENS = 5
# Emitted tokens are dropped from the front of the window list past this many.
_TRIM_AT = 256


class IncrementalDetokenizer:
    """Feed a request's generated token ids in order; get the text each one adds."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode = tokenizer.decode
        self._token_bytes = tokenizer.token_bytes
        self._style = tokenizer.style
        self._byte_tokens = tokenizer.byte_token_ids
        self._skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoded window
        self._read = 0  # tokens before this have been emitted
        self._prefix_text = ""  # decode(ids[prefix:read])
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._prime([t for t in prompt_ids if t not in self._skipped][-PROMPT_CONTEXT_TOKENS:])

    def _prime(self, context: list[int]) -> None:
        """Take prompt tokens as already emitted context, unless they end mid-character."""
        for token_id in context:
            self._ids.append(token_id)
            self._track(token_id)
        if context and self._held_back(self._text(0)):
            self._ids.clear()
            self._utf8.reset()
            return
        self._read = len(self._ids)
        self._prefix_text = self._text(0, self._read)

    def _text(self, start: int, stop: int | None = None) -> str:
        return self._decode(self._ids[start:stop], skip_special_tokens=self._skip_special_tokens)

    def _track(self, token_id: int) -> None:
        if self._style is DecoderStyle.BYTE_LEVEL:
            self._utf8.decode(self._token_bytes(token_id))

    def _held_back(self, window_text: str) -> bool:
        """Whether the window's tail could still decode differently once more tokens come."""
        if self._style is DecoderStyle.BYTE_LEVEL:
            return bool(self._utf8.getstate()[0])
        if self._style is DecoderStyle.BYTE_FALLBACK:
            return self._ids[-1] in self._byte_tokens
        return window_text.endswith("\ufffd")

    def add(self, token_id: int) -> str:
        """The text `token_id` completes; "" while it is held back or the token is skipped."""
        if token_id in self._skipped:
            return ""
        self._ids.append(token_id)
        self._track(token_id)
        if self._style is not DecoderStyle.OTHER and self._held_back(""):
            return ""
        window_text = self._text(self._prefix)
        if self._style is DecoderStyle.OTHER and self._held_back(window_text):
            return ""
        return self._emit(window_text)

    def flush(self) -> str:
        """Whatever is still held back, decoded as the full decode shows it (U+FFFD and all)."""
        if self._read == len(self._ids):
            return ""
        self._utf8.reset()
        return self._emit(self._text(self._prefix))

    def _emit(self, window_text: str) -> str:
        delta = window_text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._text(self._prefix, self._read)
        if self._prefix > _TRIM_AT:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return delta
