"""The state layer: the KV cache and per-request state, each with asserted invariants (no model code)."""
