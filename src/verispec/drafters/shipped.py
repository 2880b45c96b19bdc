"""Trained drafters shipped with verispec, by name; any other value is taken as a checkpoint directory."""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from verispec.config import LEARNED_METHODS

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


def shipped_card(name: str) -> tuple[str | None, str]:
    """(method, target model) of a shipped drafter: from its config.json where it records them (`model_type`
    dflash / dspark, `target`), else from its name, `<target>-<method>`. The method is None when neither says."""
    cfg = json.loads((shipped_root() / name / "config.json").read_text())
    stem, _, suffix = name.rpartition("-")
    method = cfg.get("model_type") if cfg.get("model_type") in LEARNED_METHODS else suffix
    return (method if method in LEARNED_METHODS else None), str(cfg.get("target") or stem)


def shipped_for(method: str, target: str) -> str | None:
    """The shipped drafter of `method` trained for `target` (a known model's name, any case), or None."""
    for name in shipped_names():
        m, t = shipped_card(name)
        if m == method and t.lower() == target.lower():
            return name
    return None


def fill_drafter(spec: Any, target: str | None, label: str, target_dir: Path) -> Any:
    """A speculative_config with its drafter filled in: a learned method (eagle3 / dflash / dspark) given without
    one gets the drafter shipped for `target` (the target's registry name; None for a model outside the registry,
    which is then an error asking for --draft-model, `label` naming the target); mtp reads the target's own
    checkpoint in `target_dir`. Anything else comes back as it was."""
    if isinstance(spec, Mapping) and spec.get("method") == "mtp" and not spec.get("model"):
        return {**spec, "model": str(target_dir)}  # the target's own MTP layers
    if not isinstance(spec, Mapping) or spec.get("method") not in LEARNED_METHODS or spec.get("model"):
        return spec
    method = spec["method"]
    name = shipped_for(method, target) if target is not None else None
    if name is None:
        shipped = [f"{n} (for {shipped_card(n)[1]})" for n in shipped_names() if shipped_card(n)[0] == method]
        raise ValueError(
            f"method {method} needs a trained drafter, and none is shipped for {label}: pass its checkpoint "
            f"directory with --draft-model DIR (speculative_config['model']); train one with `verispec train`. "
            f"Shipped {method} drafters: {', '.join(shipped) or '(none)'}")
    return {**spec, "model": name}
