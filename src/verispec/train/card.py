"""Model cards for trained drafters, and shrinking a checkpoint to the size it ships at."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from verispec.train.shards import read_meta

TITLES = {"eagle3": "EAGLE-3 head", "dflash": "DFlash block drafter", "dspark": "DSpark block drafter"}


def to_bf16(directory: str | Path) -> int:
    """Store the floating-point weights in bf16 (they are cast to the target's dtype when loaded); returns bytes."""
    p = Path(directory) / "model.safetensors"
    sd = load_file(str(p))
    sd = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}
    save_file(sd, str(p))
    return p.stat().st_size


def write_card(directory: str | Path, method: str, *, commands: list[str], data_dir: str | Path, measured: str,
               notes: list[str] = (), made: str | None = None, load: str = "while other jobs ran") -> Path:
    """README.md next to the checkpoint: what it is, the exact commands, the data, training time, measured tau.
    made: the machine (default: a 2-core AVX2 CPU); load: what else ran on it meanwhile. No date: the commit that
    ships the drafter dates it, and measurements with dates belong in docs/results."""
    made = made or "2-core AVX2 CPU, no GPU"
    d = Path(directory)
    log = json.loads((d / "train_log.json").read_text())
    meta = read_meta(data_dir)
    wall = log.get("wall_s", log.get("wall_seconds"))
    lines = [
        f"# {TITLES[method]} for SmolLM2-135M-Instruct",
        "",
        f"A verispec `{method}` drafter for the default model (`smollm2-135m-instruct`, its Q4_1 GGUF). "
        f"Use: `verispec generate ... --method {method} --draft-model {d.name}` or "
        f"`speculative_config={{\"method\": \"{method}\", \"model\": \"{d.name}\"}}`. "
        "Output is identical to plain greedy decoding (sampling stays exact); the drafter only changes speed.",
        "",
        f"## How it was made ({made})",
        "",
        "```bash",
        *commands,
        "```",
        "",
        f"- Data: {meta['num_sequences']} target responses ({meta['response_tokens']} response tokens, "
        f"{meta['tokens']} tokens in all), modes {', '.join(meta['modes'])}, max {meta['max_tokens']} tokens each, "
        f"from: {', '.join(meta['sources'])}. The project prompts share no 8-word run with the benchmark workloads "
        "(tested)" + ("; public prompt files are DeepSpec's eval prompt sets (MIT), used as inputs only."
                      if any(str(s).endswith(".jsonl") for s in meta["sources"]) else "."),
        f"- Data generation: {meta['generate_s'] / 60:.0f} min generating + {meta['capture_s'] / 60:.0f} min capturing "
        f"hidden states ({meta.get('capture', 'prefill')} capture, target path "
        f"{meta.get('quantization') or meta.get('dtype')}), on the same machine {load}.",
        f"- Training: {float(wall) / 60:.1f} min wall-clock on 2 CPU cores (budget-limited)"
        + (f", {log['train_tokens_per_s']:.0f} trained positions per second of step time on "
           f"{log.get('world_size', 1)} rank(s)" + (", bf16 autocast" if log.get("amp") == "bf16" else "")
           + "." if log.get("train_tokens_per_s") else "."),
        "",
        "## Measured",
        "",
        measured,
        "",
    ]
    if notes:
        lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    lines += ["Training log: `train_log.json` (loss curve, held-out metrics).", ""]
    out = d / "README.md"
    out.write_text("\n".join(lines))
    return out


CURVE_HEADING = "## Learning curve"
SPEED_HEADING = "## What the speed target would take"
CURVE_PNG = "learning_curve.png"


def add_curve_section(directory: str | Path, method: str, *, target: float | None = None, offset: float = 0.0,
                      data_tokens: float | None = None, note: str | None = None) -> str:
    """Fit the run's held-out curve (train/curve.py), draw it next to the checkpoint and put its extrapolation into
    the card, replacing an earlier learning-curve section (before "## Notes" where the card has one). Returns the
    section's sentence. data_tokens: the training data's response tokens (default: read from the data directory
    named in the log, when it is there)."""
    from verispec.train.curve import extrapolate, plot_curve

    d = Path(directory)
    log = json.loads((d / "train_log.json").read_text())
    if data_tokens is None and log.get("data") and (Path(log["data"]) / "meta.json").exists():
        data_tokens = read_meta(log["data"])["response_tokens"]
    ex = extrapolate(log, method, target, offset, data_tokens)
    plot_curve(ex, method, d / CURVE_PNG)
    section = [CURVE_HEADING, "", f"![learning curve]({CURVE_PNG})", "", ex.sentence()]
    if note:
        section += ["", note]
    put_section(d / "README.md", CURVE_HEADING, "\n".join(section))
    return ex.sentence()


def put_section(card: str | Path, heading: str, text: str) -> None:
    """Put `text` (a section starting with `heading`) into the card, replacing the card's section of that heading
    (up to the next "## ") where it has one: before "## Notes" where the card has that, else at the end."""
    card = Path(card)
    assert text.startswith(heading + "\n"), f"a section starts with its heading {heading!r}"
    body = card.read_text() if card.exists() else ""
    if heading + "\n" in body:  # take the old section out
        head, rest = body.split(heading + "\n", 1)
        nxt = rest.find("\n## ")
        body = head.rstrip("\n") + "\n\n" + (rest[nxt + 1:] if nxt >= 0 else "")
    block = text.rstrip("\n") + "\n\n"
    i = body.find("## Notes")
    body = body[:i] + block + body[i:] if i >= 0 else body.rstrip("\n") + "\n\n" + block
    card.write_text(body)
