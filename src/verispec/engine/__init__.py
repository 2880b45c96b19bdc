"""Continuous batching: the engine loop, the speculation policies, and a background thread for the server."""
