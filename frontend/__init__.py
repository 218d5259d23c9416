"""The HTTP process's engine side, JAX-free: the core process's handle (frontend.core_process),
the input step (frontend.input), the output processor that alone owns open requests, their
text streams, deltas and the admission count (frontend.output), and the client that ties
them (frontend.client). JAX is imported only in the core process it starts."""
