"""`verispec doctor`: checks the chain from a checkpoint to the verifier, link by link, with the reason of every
failure (checks.py, interface.py), the runtime-class table of verispec / vLLM / SGLang (registry_table.py), and the
runner with its table / JSON output (run.py)."""
