"""The execution layer: sampling and verification arithmetic, and profiling what a target forward costs."""
