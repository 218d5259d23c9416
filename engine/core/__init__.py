"""The engine core: the scheduler loop and the state it alone owns (pages, page tables, queues)."""
