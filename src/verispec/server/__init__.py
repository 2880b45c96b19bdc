"""The OpenAI-compatible HTTP server (`verispec serve`): protocol, metrics and the FastAPI app."""
