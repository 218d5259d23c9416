"""The OpenAI-compatible HTTP server: FastAPI routes, SSE streaming, metrics, lifecycle."""
