"""Incremental detokenization: token ids in, text deltas out, one instance per request.

Runs on: the output processor's receiver thread (frontend.output), one instance per
sample, inside its TextStream.
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
The byte-fallback rule costs latency only for characters spelled in byte tokens
(shown when the next ordinary token arrives, or at flush) and buys the invariant
even for token sequences a model should never produce.
Special tokens are dropped before decoding when skipped, exactly like the decoder
does, so they never split or anchor the window. Prompt context is the last few
prompt tokens whose text is final; a prompt ending mid-character loses that tail.
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
        self._prime(self._context(prompt_ids))

    def _context(self, prompt_ids: Sequence[int]) -> list[int]:
        """The last prompt tokens the decoder sees, cut back to where their text is final.

        A prompt that ends mid-character (or, with byte fallback, in byte tokens) loses
        that tail: generated tokens are decoded after the settled text before it.
        """
        end = len(prompt_ids)
        while True:
            tail, positions = [], []
            for index in range(end - 1, -1, -1):
                if prompt_ids[index] not in self._skipped:
                    tail.append(prompt_ids[index])
                    positions.append(index)
                    if len(tail) == PROMPT_CONTEXT_TOKENS:
                        break
            tail.reverse()
            if not tail or self._settled(tail):
                return tail
            end = positions[0]

    def _settled(self, ids: list[int]) -> bool:
        """Whether the text of a sequence ending in `ids` is final (see the module doc)."""
        if self._style is DecoderStyle.BYTE_LEVEL:
            decoder = codecs.getincrementaldecoder("utf-8")("replace")
            decoder.decode(b"".join(self._token_bytes(i) for i in ids))
            return not decoder.getstate()[0]
        if self._style is DecoderStyle.BYTE_FALLBACK:
            return ids[-1] not in self._byte_tokens
        return not self._decode(ids).endswith("\ufffd")

    def _prime(self, context: list[int]) -> None:
        """Take settled prompt tokens as already emitted context."""
        for token_id in context:
            self._ids.append(token_id)
            self._tail_open(token_id)
        self._read = len(self._ids)
        self._prefix_text = self._text(0, self._read)

    def _text(self, start: int, stop: int | None = None) -> str:
        return self._decode(self._ids[start:stop], skip_special_tokens=self._skip_special_tokens)

    def _tail_open(self, token_id: int) -> bool:
        """Account for an appended token; True while the text's tail cannot be final yet."""
        if self._style is DecoderStyle.BYTE_LEVEL:
            self._utf8.decode(self._token_bytes(token_id))
            return bool(self._utf8.getstate()[0])
        return token_id in self._byte_tokens  # empty unless byte fallback

    def add(self, token_id: int) -> str:
        """The text `token_id` completes; "" while it is held back or the token is skipped."""
        if token_id in self._skipped:
            return ""
        self._ids.append(token_id)
        if self._tail_open(token_id):
            return ""
        window_text = self._text(self._prefix)
        if self._style is DecoderStyle.OTHER and window_text.endswith("\ufffd"):
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
