"""Errors tokenization raises on purpose; all are ValueErrors so callers answer 400."""

from __future__ import annotations


class TokenizationError(ValueError):
    """A tokenizer cannot be loaded, or input cannot be tokenized as asked."""


class InvalidTokenError(TokenizationError):
    """A token id prompt holds an id that is not an int in [0, vocab_size)."""


class ChatTemplateError(TokenizationError):
    """Chat messages cannot be rendered: no template, or the template rejects them."""
