"""A Responses `input` as chat-template messages, as chat's messages would render.

Runs on: the server's tokenizer threads, while a request is planned. `instructions`
is a system message; a continued response's earlier items (its stored conversation:
inputs and outputs alike) come before `input`'s; message items keep their role and
text; an earlier turn's `function_call` items become that turn's assistant
`tool_calls` (consecutive calls, and calls right after an assistant message, join one
assistant message) and a `function_call_output` a `tool` message answering its
`call_id`, which is how chat's assistant tool_calls and tool messages reach the
template. A bad item is a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from server.errors import bad_request
from server.protocol import (
    MessageToolCall,
    ResponsesInputItem,
    ResponsesRequest,
    ToolCallFunction,
    parts_text,
)
from server.tools import template_tool_calls

ROLES = frozenset({"system", "developer", "user", "assistant"})
TEXT_PARTS = frozenset({"input_text", "output_text"})  # output_text: an earlier reply


def input_items(request: ResponsesRequest) -> list[ResponsesInputItem]:
    """`input` as items (a string is one user message); an empty list is a 400."""
    if isinstance(request.input, str):
        return [ResponsesInputItem(type="message", role="user", content=request.input)]
    if not request.input:
        raise bad_request("input must not be an empty list", param="input")
    return list(request.input)


def input_messages(
    request: ResponsesRequest, history: Sequence[ResponsesInputItem] = ()
) -> list[dict[str, Any]]:
    """`instructions`, the earlier turns' items (`previous_response_id`'s conversation),
    then `input`, as chat-template messages; a 400 names the bad item."""
    messages: list[dict[str, Any]] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
    items = input_items(request)
    earlier = len(history)
    for index, item in enumerate([*history, *items]):
        where = f"input[{index - earlier}]" if index >= earlier else "previous_response_id"
        try:
            if item.type == "function_call":
                _add_call(messages, item, where)
            elif item.type == "function_call_output":
                messages.append(_call_output(item, where))
            elif item.type == "message":
                messages.append(_message(item, where))
            else:
                raise ValueError(
                    f"{where}: input items of type {item.type!r} are not supported "
                    "(only message, function_call and function_call_output)"
                )
        except ValueError as exc:
            raise bad_request(str(exc), param="input") from exc
    return messages


def _message(item: ResponsesInputItem, where: str) -> dict[str, Any]:
    if item.role not in ROLES:
        roles = ", ".join(sorted(ROLES))
        raise ValueError(f"{where}.role must be one of {roles}, got {item.role!r}")
    if item.content is None:
        raise ValueError(f"{where}.content is required")
    if isinstance(item.content, str):
        return {"role": item.role, "content": item.content}
    return {"role": item.role, "content": parts_text(item.content, f"{where}.content", TEXT_PARTS)}


def _add_call(messages: list[dict[str, Any]], item: ResponsesInputItem, where: str) -> None:
    """The call joins the assistant message before it, or starts one."""
    for field in ("call_id", "name"):
        if not getattr(item, field):
            raise ValueError(f"{where}.{field} is required for a function_call")
    call = MessageToolCall(
        id=item.call_id, function=ToolCallFunction(name=item.name or "", arguments=item.arguments)
    )
    [rendered] = template_tool_calls([call], where)
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(rendered)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [rendered]})


def _call_output(item: ResponsesInputItem, where: str) -> dict[str, Any]:
    if not item.call_id:
        raise ValueError(f"{where}.call_id is required for a function_call_output")
    if item.output is None:
        raise ValueError(f"{where}.output is required for a function_call_output")
    output = item.output
    if not isinstance(output, str):
        output = parts_text(output, f"{where}.output", TEXT_PARTS)
    return {"role": "tool", "content": output, "tool_call_id": item.call_id}
