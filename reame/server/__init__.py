"""The OpenAI-compatible HTTP server (stdlib http.server + threads)."""
