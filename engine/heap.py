"""The garbage collector's view of what a process built at startup.

Owns nothing; `freeze_startup_heap` is called once a process is ready to serve (the
engine core after warm-up, the HTTP process when its backend is loaded). A full
collection walks every tracked object, and after startup that is JAX's, the
tokenizer's and the web stack's hundreds of thousands: ~300 ms in a warmed core
(bench/README), a stop of the core's loop or the event loop mid-stream whenever
serving's allocations set one off. Frozen objects are never walked again (vLLM's
`freeze_gc_heap`, at the same two points).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect what startup left behind, then freeze the rest; the number frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
