"""How a fast tokenizer's decoder turns token strings into bytes.

Owns: the decoder style of a tokenizer (byte-level, byte fallback or other) and the
per-token byte mapping each style implies. The incremental detokenizer needs this to
know when decoded text is final, and chat logprobs need a token's raw bytes. The
rules mirror the `tokenizers` decoders exactly: ByteLevel maps each character back
through GPT-2's byte table (a token with any character outside the table is taken
as its UTF-8 bytes), ByteFallback turns `<0xXX>` tokens into single bytes and
decodes each run of them as one UTF-8 string (all U+FFFD when the run is invalid).
"""

from __future__ import annotations

import enum
import json
from functools import cache
from typing import Any


class DecoderStyle(enum.Enum):
    """Which byte rules the tokenizer's decoder follows."""

    BYTE_LEVEL = "byte_level"  # GPT-2, Llama 3, Qwen: every token is bytes via a char table
    BYTE_FALLBACK = "byte_fallback"  # SentencePiece BPE (Llama 2, Mistral): <0xXX> tokens
    OTHER = "other"  # WordPiece and friends: no byte tokens, text only


SPIECE_UNDERLINE = "\u2581"


@cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable character table, character -> byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_types(node: Any) -> set[str]:
    """Every decoder `type` named anywhere in a serialized decoder (Sequence included)."""
    found: set[str] = set()
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            found.add(node["type"])
        for value in node.values():
            found |= _decoder_types(value)
    elif isinstance(node, list):
        for value in node:
            found |= _decoder_types(value)
    return found


def detect_style(backend_json: str) -> DecoderStyle:
    """The style of a `tokenizers.Tokenizer` given its `to_str()` JSON."""
    types = _decoder_types(json.loads(backend_json).get("decoder"))
    if "ByteLevel" in types:
        return DecoderStyle.BYTE_LEVEL
    if "ByteFallback" in types:
        return DecoderStyle.BYTE_FALLBACK
    return DecoderStyle.OTHER


def byte_token_value(token: str) -> int | None:
    """The byte a ByteFallback token such as `<0xE2>` stands for, else None."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return int(token[3:5], 16)
        except ValueError:
            return None
    return None


def token_to_bytes(token: str, style: DecoderStyle) -> bytes:
    """The bytes one token string contributes to decoded text, before UTF-8 decoding."""
    if style is DecoderStyle.BYTE_LEVEL:
        table = _byte_level_decoder()
        if all(c in table for c in token):
            return bytes(table[c] for c in token)
        return token.encode("utf-8")
    if style is DecoderStyle.BYTE_FALLBACK:
        value = byte_token_value(token)
        if value is not None:
            return bytes([value])
        return token.replace(SPIECE_UNDERLINE, " ").encode("utf-8")
    return token.encode("utf-8")
