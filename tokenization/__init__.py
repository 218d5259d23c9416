"""Text in and out of the model: tokenizer, chat template, incremental detokenizer, stops."""

from tokenization.detokenizer import IncrementalDetokenizer
from tokenization.errors import ChatTemplateError, InvalidTokenError, TokenizationError
from tokenization.stop import StopMatcher, StopResult
from tokenization.stream import TextStep, TextStream
from tokenization.tokenizer import Tokenizer

__all__ = [
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "InvalidTokenError",
    "StopMatcher",
    "StopResult",
    "TextStep",
    "TextStream",
    "TokenizationError",
    "Tokenizer",
]
