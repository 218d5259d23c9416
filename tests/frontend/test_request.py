"""RequestStream's hand-off from a pushing thread to an asyncio consumer."""

from __future__ import annotations

import asyncio
import threading

from frontend.request import Delta, RequestStream, Wakeups


def delta(index: int, text: str) -> Delta:
    return Delta(index, text, (1,), None, None, None, prompt_tokens=1, completion_tokens=1)


def test_batched_pushes_wake_each_consumer_once_the_batch_is_woken() -> None:
    streams = [RequestStream(f"r{i}", 1) for i in range(3)]

    async def main() -> list[list[str]]:
        loop = asyncio.get_running_loop()
        calls = []
        wrapped = loop.call_soon_threadsafe

        def counted(*args):  # type: ignore[no-untyped-def]
            calls.append(args[0].__name__)
            return wrapped(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        got: list[list[str]] = [[] for _ in streams]

        async def consume(i: int) -> None:
            async for d in streams[i]:
                got[i].append(d.text)

        tasks = [asyncio.create_task(consume(i)) for i in range(len(streams))]
        await asyncio.sleep(0.05)  # every consumer is waiting on its empty stream
        wakeups = Wakeups()
        pushed = threading.Event()

        def push() -> None:
            for i, stream in enumerate(streams):
                assert stream.push(delta(0, f"a{i}"), wakeups)
            pushed.set()

        thread = threading.Thread(target=push)
        thread.start()
        thread.join()
        assert pushed.is_set()
        await asyncio.sleep(0.05)
        assert got == [[], [], []]  # pushed, but nobody woken yet
        assert calls == []
        wakeups.wake()
        await asyncio.sleep(0.05)
        assert got == [["a0"], ["a1"], ["a2"]]
        assert calls == ["_resolve_all"]  # one call for the three consumers
        for i, stream in enumerate(streams):  # unbatched: each push wakes its consumer
            stream.push(delta(0, f"b{i}"))
            stream.close()
        await asyncio.gather(*tasks)
        assert calls.count("_resolve") >= 1
        return got

    assert asyncio.run(main()) == [["a0", "b0"], ["a1", "b1"], ["a2", "b2"]]


def test_a_closed_stream_refuses_a_batched_push() -> None:
    stream = RequestStream("r", 1)
    stream.close()
    wakeups = Wakeups()
    assert not stream.push(delta(0, "x"), wakeups)
    wakeups.wake()  # nothing to wake: no loop was recorded
