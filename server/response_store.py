"""Stored Responses: what GET, cancel, delete and `previous_response_id` read.

Runs on: the event loop; one store per app (server.routes.Served), its only owner.
Receives from /v1/responses each stored response object as it changes (queued, in
progress, then completed, incomplete or failed) with the conversation it ends (its
predecessors' items, its own input items and its output items) and, for a background
response, the task that runs it. Emits a stored object to GET, the conversation to a
request that continues it, and cancels a background task. A response that was
cancelled keeps that status whatever its task writes afterwards.

Bounded: at most `capacity` responses, the least recently stored dropped first (a
background response still running is kept). It lives in this server's memory: behind a
load balancer with several replicas, a later request that names a response must reach
the same replica, and a restart forgets them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from server.errors import APIError, bad_request

RUNNING = frozenset({"queued", "in_progress"})


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object, as GET returns it
    conversation: tuple[dict[str, Any], ...]  # input items a continuation starts from
    background: bool = False
    task: asyncio.Task[None] | None = None  # a background response's run

    @property
    def running(self) -> bool:
        return self.body.get("status") in RUNNING


def not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(
        404, f"Response with id '{response_id}' not found.", param=param, code="not_found"
    )


class ResponseStore:
    """Responses by id, oldest dropped past `capacity` (0: none are stored)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Store (or replace) a response; the oldest finished ones go past capacity."""
        if not self.enabled:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        excess = len(self._items) - self.capacity
        old = [i for i, s in self._items.items() if not s.running and i != response_id]
        for old_id in old[: max(0, excess)]:
            del self._items[old_id]

    def update(
        self,
        response_id: str,
        body: dict[str, Any],
        conversation: tuple[dict[str, Any], ...] | None = None,
    ) -> None:
        """A stored response's new state, unless it was cancelled or dropped meanwhile."""
        stored = self._items.get(response_id)
        if stored is None or stored.body.get("status") == "cancelled":
            return
        stored.body = body
        if conversation is not None:
            stored.conversation = conversation

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        stored = self._items.get(response_id)
        if stored is None:
            raise not_found(response_id, param)
        return stored

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """Cancel a background response still running: its status "cancelled", its run
        stopped (the engine's requests aborted). Others are a 400, as vLLM answers."""
        stored = self.get(response_id)
        if not stored.background:
            raise bad_request("Cannot cancel a synchronous response.", param="response_id")
        if not stored.running:
            status = stored.body.get("status")
            raise bad_request(
                f"Cannot cancel a response whose status is {status}.", param="response_id"
            )
        stored.body = {**stored.body, "status": "cancelled"}
        await _stop(stored.task)
        return stored.body

    async def delete(self, response_id: str) -> dict[str, Any]:
        """Forget a response (a running one is cancelled first); OpenAI's deletion object."""
        stored = self.get(response_id)
        del self._items[response_id]
        await _stop(stored.task)
        return {"id": response_id, "object": "response", "deleted": True}


async def _stop(task: asyncio.Task[None] | None) -> None:
    if task is None or task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
