"""`dsv4 serve`: an OpenAI-compatible HTTP server on the engine."""
