"""The `verispec bench` subcommands beyond single and sweep: each names where its arguments are added and what runs
it, so the command line (cli.py) lists them from this one table, as `vllm bench latency | throughput | serve` do.
The measurements behind the README's results table run from here; one-off studies live under benchmarks/studies/
and import what they share from this package (bench/common.py, bench/replay.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from importlib import import_module
from typing import Callable


@dataclass(frozen=True)
class BenchCommand:
    help: str
    module: str  # verispec.bench.<module>, imported only when the subcommand is parsed or run
    add_args: str  # its function (parser) -> None
    run: str  # its function (namespace) -> exit code

    def adder(self) -> Callable[[argparse.ArgumentParser], None]:
        return getattr(import_module(f"verispec.bench.{self.module}"), self.add_args)

    def runner(self) -> Callable[[argparse.Namespace], int]:
        return getattr(import_module(f"verispec.bench.{self.module}"), self.run)


COMMANDS: dict[str, BenchCommand] = {
    "llama": BenchCommand("plain decoding of one GGUF against llama.cpp's llama-bench, interleaved", "vs_llama",
                          "add_llama_args", "run_llama_cli"),
    "formats": BenchCommand("the GGUF formats people download and real model shapes (synthetic weights) against "
                            "llama-bench, with the verify curve, synthetic acceptance and peak RSS", "formats",
                            "add_formats_args", "run_formats_cli"),
    "drafters": BenchCommand("learned drafters per workload: tau, speed against plain, identity, online calibration",
                             "drafters", "add_drafters_args", "run_drafters_cli"),
}
