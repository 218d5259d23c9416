"""The allowed-token bitmask's host form: which tokens a row may sample, as int32 words.

Owns: the layout (token t is bit t % 32 of word t // 32) and building a mask from ids.
Receives token ids; emits numpy words, which engine.sampling applies on the device and the
scheduler intersects with structured outputs' masks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mask_words(vocab_size: int) -> int:
    """int32 words of an allowed-token bitmask: token t is bit t % 32 of word t // 32."""
    return -(-vocab_size // 32)


def token_bitmask(allowed: Sequence[int] | None, vocab_size: int) -> np.ndarray:
    """The allowed-token bitmask of these ids (None: every token), as int32 words."""
    words = mask_words(vocab_size)
    if allowed is None:
        return np.full((words,), -1, np.int32)
    bits = np.zeros((words * 32,), bool)
    bits[np.asarray(allowed, np.int64)] = True
    packed = np.packbits(bits.reshape(words, 32), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<i4")[:, 0].astype(np.int32)
