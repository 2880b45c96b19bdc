"""Trained drafters shipped with verispec, by name; any other value is taken as a checkpoint directory."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

SHIPPED_DIR = "shipped"  # package data: verispec/drafters/shipped/<name>/{config.json,model.safetensors,README.md}


def shipped_root() -> Path:
    return Path(str(resources.files("verispec.drafters"))) / SHIPPED_DIR


def shipped_names() -> list[str]:
    root = shipped_root()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "config.json").exists())


def resolve(name_or_path: str) -> Path:
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return p
    if name_or_path in shipped_names():
        return shipped_root() / name_or_path
    raise FileNotFoundError(
        f"no trained drafter at {name_or_path!r}: pass a checkpoint directory (from `verispec train ...`) or one of "
        f"the shipped drafters {shipped_names() or '(none installed)'}")
