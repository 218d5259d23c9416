"""POST /tokenize and /detokenize: vLLM's token-count endpoints.

/tokenize takes `prompt` (text, special tokens added by default) or `messages`
(rendered through the chat template exactly as /v1/chat/completions renders them,
with `tools` too, no special tokens added on top by default) and answers
`{"count", "max_model_len", "tokens"}`; /detokenize turns `tokens` back into
`{"prompt": text}`, special tokens included, as vLLM decodes them.
"""

from __future__ import annotations

from typing import Any

from server.backend import ModelLimits, TokenizerClient
from server.chat import render_messages, template_flags, template_messages
from server.errors import APIError, bad_request
from server.params import check_token_ids
from server.protocol import DetokenizeRequest, TokenizeRequest
from server.tools import tool_dicts


def tokenize(
    request: TokenizeRequest, tokenizer: TokenizerClient, model_name: str, limits: ModelLimits
) -> dict[str, Any]:
    _check_model(request.model, model_name)
    if request.return_token_strs:
        raise bad_request(
            "return_token_strs is not supported", param="return_token_strs", code="unsupported"
        )
    if (request.prompt is None) == (request.messages is None):
        raise bad_request(
            "give either `prompt` (text) or `messages` (a chat), not both or neither",
            param="messages" if request.messages is not None else "prompt",
        )
    if request.messages is not None:
        add_generation_prompt, continue_final_message = template_flags(request)
        ids = list(
            render_messages(
                template_messages(request.messages),
                tokenizer,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                add_special_tokens=bool(request.add_special_tokens),
                tools=tool_dicts(request.tools),
            )
        )
    else:
        add_special_tokens = request.add_special_tokens is not False
        try:
            ids = tokenizer.encode(request.prompt or "", add_special_tokens=add_special_tokens)
        except ValueError as exc:
            raise bad_request(f"prompt could not be tokenized: {exc}", param="prompt") from exc
    return {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids}


def detokenize(
    request: DetokenizeRequest, tokenizer: TokenizerClient, model_name: str
) -> dict[str, Any]:
    _check_model(request.model, model_name)
    if request.tokens:
        check_token_ids(tokenizer, request.tokens, "tokens")
    return {"prompt": tokenizer.decode(request.tokens, skip_special_tokens=False)}


def _check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(
            404, f"The model `{requested}` does not exist.", param="model", code="model_not_found"
        )
