"""The orchestrator's stages: one thread each, bounded queues and typed messages between them.

prefill.py -> generate.py -> detokenize.py; messages.py declares what crosses
between them, queues.py the blocking primitives every stage uses so that a
stop request never leaves a thread waiting forever.
"""
