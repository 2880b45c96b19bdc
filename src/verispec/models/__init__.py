"""Model registry and local model management."""
