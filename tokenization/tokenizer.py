"""The tokenizer of one checkpoint: text <-> ids, EOS ids, chat template, token bytes.

Owns: the fast Hugging Face tokenizer loaded from a local checkpoint folder (never a
hub) and everything derived from it once at load. Shared by the server's tokenizer
threads and the output processor's receiver thread (frontend.output); the engine core
loads its own (EOS ids, grammars). Encode and decode go straight to the Rust
tokenizer, whose settings are never changed after load, so threads never race on it;
the one thing filled in later, the cache of token bytes, is written under a lock.
"""

from __future__ import annotations

import json
import logging
import numbers
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenization import chat
from tokenization.byte_decoding import DecoderStyle, byte_token_value, detect_style, token_to_bytes
from tokenization.errors import ChatTemplateError, InvalidTokenError, TokenizationError
from tokenization.grammar import GrammarCompiler

__all__ = [
    "ChatTemplateError",
    "InvalidTokenError",
    "TokenizationError",
    "Tokenizer",
]

logger = logging.getLogger(__name__)


def _generation_eos_ids(folder: Path) -> set[int]:
    """eos_token_id of generation_config.json (int or list), empty when absent."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return set()
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError) as exc:
        raise TokenizationError(f"cannot read {path.name}: {exc}") from exc
    if value is None:
        return set()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TokenizationError(f"{path.name}: eos_token_id must be an int or a list of ints")
    return set(values)


def _json_value(value: Any) -> Any:
    """A tokenizer argument as JSON: special tokens as their text, other objects as text."""
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    content = getattr(value, "content", None)  # transformers' AddedToken
    return content if isinstance(content, str) else str(value)


class Tokenizer:
    """A checkpoint's fast tokenizer with the few operations serving needs."""

    def __init__(
        self,
        hf: Any,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        chat_template: str | None = None,
    ) -> None:
        if not getattr(hf, "is_fast", False):
            raise TokenizationError("only fast (tokenizer.json) tokenizers are supported")
        self.hf = hf
        self._backend = hf.backend_tokenizer
        self._chat_template = chat_template
        self.vocab_size: int = max(len(hf), self._backend.get_vocab_size(with_added_tokens=True))
        eos = set(eos_token_ids)
        if hf.eos_token_id is not None:
            eos.add(int(hf.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.bos_token_id: int | None = hf.bos_token_id
        self.style: DecoderStyle = detect_style(self._backend.to_str())
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in self._backend.get_added_tokens_decoder().items() if tok.special
        )
        self.byte_token_ids: frozenset[int] = self._byte_token_ids()
        self._bytes_cache: dict[int, bytes] = {}
        self._bytes_lock = threading.Lock()
        self._grammar_compilers: dict[int, GrammarCompiler] = {}
        self._grammar_lock = threading.Lock()  # held while a compiler is built

    @classmethod
    def from_folder(cls, path: str | Path, *, chat_template: str | None = None) -> Tokenizer:
        """Load from a local checkpoint folder; `chat_template` (the text) overrides its own."""
        from transformers import AutoTokenizer

        folder = Path(path)
        if not folder.is_dir():
            raise TokenizationError(f"checkpoint folder {str(folder)!r} does not exist")
        try:
            hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, use_fast=True)
        except Exception as exc:  # corrupt files raise bare Exceptions from the Rust side
            raise TokenizationError(
                f"cannot load a fast tokenizer from {str(folder)!r}: {exc}"
            ) from exc
        eos = frozenset(_generation_eos_ids(folder))
        tokenizer = cls(hf, eos_token_ids=eos, chat_template=chat_template)
        logger.info(
            "tokenizer: %d ids, %s decoder, eos %s, bos %s, chat template: %s",
            tokenizer.vocab_size,
            tokenizer.style.value,
            sorted(tokenizer.eos_token_ids),
            tokenizer.bos_token_id,
            "given" if chat_template else ("checkpoint" if tokenizer.has_chat_template else "none"),
        )
        return tokenizer

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's configuration as vLLM's /tokenizer_info gives it: the arguments it
        was loaded with (tokenizer_config.json's), less file locations, with its class and
        the chat template in use."""
        config = {
            key: _json_value(value)
            for key, value in dict(getattr(self.hf, "init_kwargs", None) or {}).items()
            if not key.endswith("_file") and key != "name_or_path"
        }
        config["tokenizer_class"] = type(self.hf).__name__
        template = self._chat_template or getattr(self.hf, "chat_template", None)
        if template:
            config["chat_template"] = template
        return config

    @property
    def has_chat_template(self) -> bool:
        """Whether chat requests can be served: a template was given or the checkpoint has one."""
        return bool(self._chat_template or getattr(self.hf, "chat_template", None))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds BOS (and the like) as the model expects.

        Through encode_batch, which releases the GIL (plain encode holds it: a 1 MB prompt
        froze every other thread, the event loop's included, for ~1 s).
        """
        batch = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(batch[0].ids)

    def validate_ids(self, ids: Sequence[int]) -> list[int]:
        """A token-id prompt as plain ints; InvalidTokenError names the first id that is no
        integer, or every id out of the vocabulary (with its position)."""
        out: list[int] = []
        bad: list[str] = []
        for position, token_id in enumerate(ids):
            if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
                raise InvalidTokenError(
                    f"token id at position {position} is {token_id!r}, not an integer"
                )
            value = int(token_id)
            if not 0 <= value < self.vocab_size:
                bad.append(f"{value} at position {position}")
            out.append(value)
        if bad:
            shown = ", ".join(bad[:64]) + (f" and {len(bad) - 64} more" if len(bad) > 64 else "")
            which = "token id" if len(bad) == 1 else "token ids"
            are = "is" if len(bad) == 1 else "are"
            raise InvalidTokenError(
                f"{which} {shown} {are} out of vocabulary (valid ids are "
                f"0..{self.vocab_size - 1}, vocabulary size {self.vocab_size})"
            )
        return out

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids` without clean-up of spaces, so it equals the streamed deltas joined."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> Any:
        """A new incremental detokenizer for one sample that follows `prompt_ids`."""
        from tokenization.detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes this token contributes to decoded text (chat logprobs' `bytes`)."""
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            token = self._backend.id_to_token(token_id)
            if token is None:
                raise InvalidTokenError(
                    f"token id {token_id} is outside the vocabulary of size {self.vocab_size}"
                )
            cached = token_to_bytes(token, self.style)
            with self._bytes_lock:
                self._bytes_cache[token_id] = cached
        return cached

    def token_text(self, token_id: int) -> str:
        """One token as logprobs show it: its decoded text, or "bytes:\\xe2" for a partial byte."""
        text = self._backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text
        raw = self.token_bytes(token_id)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text

    def _byte_token_ids(self) -> frozenset[int]:
        """Ids of ByteFallback `<0xXX>` tokens (empty for other styles)."""
        if self.style is not DecoderStyle.BYTE_FALLBACK:
            return frozenset()
        return frozenset(
            i
            for tok, i in self._backend.get_vocab(with_added_tokens=True).items()
            if byte_token_value(tok) is not None
        )

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat prompt as text (what apply_chat_template tokenizes)."""
        return chat.render(
            self.hf,
            messages,
            template=self._chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            template_kwargs=template_kwargs,
        )

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Prompt ids of chat messages; the template itself writes BOS, so by default none is
        added (add_special_tokens adds them on top, as vLLM's /tokenize may ask)."""
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            template_kwargs=template_kwargs,
        )
        return self.encode(text, add_special_tokens=add_special_tokens)

    def grammar_compiler(self, vocab_size: int) -> GrammarCompiler:
        """The structured-output compiler for a model of `vocab_size` ids, built on first use
        (~1 s for a 50k vocabulary) and kept: one per tokenizer and vocabulary size."""
        with self._grammar_lock:
            compiler = self._grammar_compilers.get(vocab_size)
            if compiler is None:
                compiler = GrammarCompiler(self.hf, vocab_size, self.eos_token_ids)
                self._grammar_compilers[vocab_size] = compiler
            return compiler
