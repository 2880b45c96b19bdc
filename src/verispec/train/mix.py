"""`verispec train mix-data`: one training directory from several data sets of the same target (a large general set
and a smaller one of the formats a deployment serves, say), so that a drafter continues on both at once instead of
forgetting the first. Shards are hard-linked (copied where the file system refuses) and renumbered in the order the
sets are given; nothing is recomputed. The target, its hidden size and the path that captured the states must
agree; the layers kept are those every set holds. A mixed directory is not extended by `train data`."""

from __future__ import annotations

from pathlib import Path

from verispec.train.shards import link_shard, read_meta, shard_name, write_meta

MUST_AGREE = ("model", "num_layers", "hidden_size", "dtype", "quantization")
SUMMED = ("num_sequences", "tokens", "response_tokens", "generate_s", "capture_s", "jobs_total")


def _union(lists) -> list:
    return list(dict.fromkeys(x for xs in lists for x in xs))


def mix_sets(out_dir: str | Path, sets: list[str | Path]) -> dict:
    """Join `sets` into `out_dir` (new or empty); returns the joined meta, whose `mixed_from` names the sets."""
    if len(sets) < 2:
        raise ValueError("mix-data joins two or more data directories")
    metas = [read_meta(s) for s in sets]
    for k in MUST_AGREE:
        vals = {str(m.get(k)) for m in metas}
        if len(vals) > 1:
            raise ValueError(f"the data sets differ in {k} ({', '.join(sorted(vals))}): they were not captured from "
                             "the same target on the same path")
    layers = sorted(set.intersection(*(set(m["layers"]) for m in metas)))
    if not layers:
        raise ValueError("the data sets share no captured layer")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; mix into a new directory")
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for s, m in zip(sets, metas):
        for i in m["shards"]:
            link_shard(Path(s) / shard_name(i), out / shard_name(n))
            n += 1
    captures = {m.get("capture", "prefill") for m in metas}
    meta = {**metas[0], "layers": layers, "sources": _union(m["sources"] for m in metas),
            "modes": _union(m["modes"] for m in metas), "max_tokens": max(m["max_tokens"] for m in metas),
            "shards": list(range(n)), "part": [0, 1], "mixed_from": [str(Path(s).resolve()) for s in sets],
            "capture": captures.pop() if len(captures) == 1 else "mixed"}
    for k in SUMMED:
        meta[k] = round(sum(m.get(k, 0) for m in metas), 1)
    write_meta(out, meta)
    return meta
