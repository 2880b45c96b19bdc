"""verispec's own CPU kernels: the C source, building it for this machine, choosing its bodies by measurement, and
the weight formats that run on it (int4 groups, GGUF blocks with int8 activations). Below the model layer: nothing
here imports models, state or anything above."""
