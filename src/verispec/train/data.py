"""`verispec train data`: self-distillation data. The target answers a prompt corpus (greedy and sampled) and the
hidden states the drafters read are recorded as it generates (`capture="generation"`: the engine returns the
states its forwards computed, `SamplingParams.return_hidden_states`; the last token, never fed, is left out), or
recomputed afterwards in one batched prefill (`"prefill"`: responses from an endpoint, or data begun that way);
shards are written as they finish, so an interrupted run resumes where it stopped (finished shards are kept, the
rest are redone)."""

from __future__ import annotations

import argparse
import json
import time
from contextlib import closing
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from verispec.execution.features import dflash_layers, eagle3_layers
from verispec.train.corpus import project_prompts
from verispec.train.corpus_formats import format_prompts
from verispec.train.shards import link_shard, read_meta, shard_name, write_meta, write_shard

# settings that must match for a resumed run to extend the same data set
_FIXED = ("model", "layers", "sources", "modes", "max_tokens", "temperature", "shard_size", "seed", "jobs_total",
          "responder", "quantization", "capture")
_DEFAULTS = {"responder": "local", "quantization": None, "capture": "prefill"}  # data written before the key existed
CAPTURES = ("auto", "generation", "prefill")
MIXED = "mixed"  # the capture of a directory merged from parts of both modes


def default_layers(num_layers: int) -> list[int]:
    """What EAGLE-3 and DFlash / DSpark (1..5 draft layers) read: captured once for all of them."""
    s = set(eagle3_layers(num_layers))
    for n in (1, 2, 3, 5):
        s |= set(dflash_layers(num_layers, n))
    return sorted(s)


def read_prompt_file(path: str, limit: int | None) -> list[dict]:
    """JSONL with {"turns": [...]} (first turn used), {"prompt": ...} or {"messages": [...]} per line."""
    out = []
    # JSONL lines end at "\n" only: str.splitlines() would also cut at U+2028 and the like inside a JSON string
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").split("\n")):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {i + 1}: not JSON ({e})") from None
        if "messages" in obj:
            msgs = obj["messages"]
        elif "turns" in obj:
            msgs = [{"role": "user", "content": obj["turns"][0]}]
        elif "prompt" in obj:
            msgs = [{"role": "user", "content": obj["prompt"]}]
        else:
            raise ValueError(f"{path}, line {i + 1}: needs 'turns', 'prompt' or 'messages'")
        out.append({"id": f"{Path(path).stem}-{i:04d}", "messages": msgs})
        if limit is not None and len(out) >= limit:
            break
    return out


def collect_prompts(files: list[str], per_file: int | None, project: bool, formats: bool = False) -> list[dict]:
    """All sources, interleaved round-robin, so that any prefix of the data (a stopped run) mixes every source."""
    sources = []
    for use, made in ((project, project_prompts), (formats, format_prompts)):
        if use:
            sources.append([{"id": p["id"], "messages": [{"role": "user", "content": p["prompt"]}]} for p in made()])
    for f in files:
        sources.append(read_prompt_file(f, per_file))
    prompts = [s[i] for i in range(max((len(s) for s in sources), default=0)) for s in sources if i < len(s)]
    if not prompts:
        raise ValueError("no prompts: pass --prompts FILE.jsonl or keep the project's own prompts")
    return prompts


def _resume(out: Path, meta: dict) -> dict:
    """The meta to extend: the directory's own when it holds data made with the same settings (refused when not),
    else the fresh `meta`."""
    if not (out / "meta.json").exists():
        return meta
    old = read_meta(out)
    if "mixed_from" in old:
        raise ValueError(f"{out} was mixed from several data sets (`train mix-data`) and is not extended; write new "
                         "data into its own directory and mix it in")
    diff = [k for k in _FIXED if old.get(k, _DEFAULTS.get(k)) != meta[k]]
    if diff:
        raise ValueError(f"{out} holds data made with other settings ({', '.join(diff)} differ); "
                         "use another --out directory or delete it")
    return {**old, "responder": meta["responder"], "part": meta["part"]}


def _fitting(llm, prompts: list[dict], max_tokens: int) -> list[dict]:
    """The prompts (with their token ids) that fit the model's length together with a response."""
    fits = []
    for p in prompts:
        if "ids" in p:  # already token ids (models without a tokenizer)
            ids = p["ids"]
        else:
            ids = llm.tokenizer(llm.apply_chat_template(p["messages"]), add_special_tokens=False)["input_ids"]
        if len(ids) + max_tokens <= llm.max_model_len:
            fits.append({**p, "ids": list(ids)})
    return fits


def _params(mode: str, job: int, max_tokens: int, temperature: float, seed: int, record: tuple[int, ...]):
    from verispec.sampling import SamplingParams

    if mode == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, return_hidden_states=record)
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=job_seed(seed, job),
                          return_hidden_states=record)


def _shards_done(llm, endpoint, jobs: list[tuple[dict, str]], todo: list[int], shard_size: int, max_tokens: int,
                 temperature: float, seed: int, record: tuple[int, ...]) -> Iterator[tuple[int, list, list | None]]:
    """(shard, its responses (token ids), their recorded {layer: [n, d]} states or None) for every shard of `todo`
    as it finishes: from the endpoint a shard at a time, or from the local engine fed across shards."""
    chunk = lambda i: jobs[i * shard_size : (i + 1) * shard_size]  # noqa: E731
    if endpoint is None:
        return _engine_shards(llm, chunk, todo, shard_size, max_tokens, temperature, seed, record)
    return ((i, endpoint.respond([(p["ids"], mode, job_seed(seed, i * shard_size + j))
                                  for j, (p, mode) in enumerate(chunk(i))], max_tokens, temperature), None)
            for i in todo)


def _engine_shards(llm, chunk, todo: list[int], shard_size: int, max_tokens: int, temperature: float, seed: int,
                   record: tuple[int, ...]) -> Iterator[tuple[int, list, list | None]]:
    """The local engine with twice its max_num_seqs requests in flight across shard boundaries, so small shards
    (cheap to lose when a run stops) keep it full; a shard is yielded when its last response ends."""
    from verispec.execution.hidden_states import hidden_states
    from verispec.state.request import Request

    engine, d = llm.engine, llm.model.cfg.hidden_size
    feed = iter(todo)
    inflight: dict[int, list[Request]] = {}
    unfinished = lambda: sum(not r.finished for rs in inflight.values() for r in rs)  # noqa: E731
    try:
        while True:
            while unfinished() < 2 * llm.max_num_seqs and (i := next(feed, None)) is not None:
                inflight[i] = [Request(list(p["ids"]), _params(mode, i * shard_size + j, max_tokens, temperature,
                                                               seed, record)) for j, (p, mode) in enumerate(chunk(i))]
                for r in inflight[i]:
                    engine.add_request(r)
            if not inflight:
                return
            engine.step()
            for i in [i for i, rs in inflight.items() if all(r.finished for r in rs)]:
                rs = inflight.pop(i)
                bad = [r for r in rs if r.finish_reason not in ("stop", "length")]
                if bad:
                    raise RuntimeError(f"shard {i}: a response failed ({bad[0].finish_reason}: {bad[0].error})")
                yield i, [list(r.output_ids) for r in rs], [hidden_states(r, d) for r in rs] if record else None
    finally:  # stopped (an error, an interrupt, the caller gone): nothing of ours stays in the engine
        if unfinished():
            engine.fail_all("train data stopped")


def _recorded(model, full: list[list[int]], recorded: list, layers: list[int]
              ) -> list[tuple[list[int], dict, torch.Tensor]]:
    """(ids, {layer: [n, d]}, last_hidden [n, d]) per sequence from the states recorded while generating: the ids
    without the last token (never fed, it has no state); last_hidden through the model's own final norm."""
    from verispec.models.linear import rms_norm

    L = model.cfg.num_layers
    out = []
    for ids, h in zip(full, recorded):
        assert h[layers[0]].shape[0] == len(ids) - 1, "one recorded row per fed position"
        out.append((ids[:-1], {k: h[k] for k in layers}, rms_norm(h[L], model.norm, model.cfg.rms_norm_eps)))
    return out


def _capture_mode(capture: str, endpoint, out: Path) -> str:
    """"generation" or "prefill": auto takes the directory's own (a resumed run), else generation unless the
    responses come from an endpoint (which returns no states)."""
    if capture not in CAPTURES:
        raise ValueError(f"capture must be one of {', '.join(CAPTURES)}, got {capture!r}")
    if capture == "generation" and endpoint is not None:
        raise ValueError("capture='generation' needs the local engine; responses from an endpoint are captured in "
                         "a batched prefill (capture='prefill')")
    own = read_meta(out).get("capture", _DEFAULTS["capture"]) if (out / "meta.json").exists() else None
    if own == MIXED:
        raise ValueError(f"{out} was merged from parts of different capture modes and is not extended; write a new "
                         "part into its own directory and merge it in")
    if capture != "auto":
        return capture
    if own is not None:
        return own
    return "prefill" if endpoint is not None else "generation"


def job_seed(seed: int, job: int) -> int:
    """The sampling seed of job number `job` (global over the whole job list, so parts and resumes agree)."""
    return seed * 1_000_003 + job


def generate_data(llm, out_dir: str, prompts: list[dict], *, sources: list[str], modes: tuple[str, ...] = ("greedy",),
                  max_tokens: int = 256, temperature: float = 0.7, shard_size: int = 32, seed: int = 0,
                  layers: list[int] | None = None, endpoint=None, part: tuple[int, int] = (0, 1),
                  capture: str = "auto", progress: bool = True) -> dict:
    """Write shards of (prompt + response) with captured hidden states; returns meta. Resumes a partial run.

    Responses come from `llm` itself (fed continuously across shards) or, with `endpoint` (train/endpoint.py), from
    an OpenAI-compatible server of the same target; the hidden states are recorded while generating or recomputed
    here in batched prefill (`capture`: generation / prefill / auto, see `_capture_mode`). `part` = (i, n): only
    shards s with s % n == i (n machines each run one part into their own directory; `merge_parts` joins them)."""
    model = llm.model
    layers = sorted(layers or default_layers(model.cfg.num_layers))
    bad = [i for i in layers if not 0 <= i <= model.cfg.num_layers]
    if bad:
        raise ValueError(f"layers {bad} are outside 0..{model.cfg.num_layers}")
    if not (0 <= part[0] < part[1]):
        raise ValueError(f"part {part[0]}/{part[1]}: needs 0 <= i < n")
    fits = _fitting(llm, prompts, max_tokens)
    skipped = len(prompts) - len(fits)
    jobs = [(p, m) for p in fits for m in modes]
    out = Path(out_dir)
    capture = _capture_mode(capture, endpoint, out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": llm.resolved.name, "num_layers": model.cfg.num_layers, "hidden_size": model.cfg.hidden_size,
            "dtype": str(model.dtype).removeprefix("torch."), "quantization": getattr(llm, "quantization", None),
            "layers": layers, "sources": sources,
            "modes": list(modes), "max_tokens": max_tokens, "temperature": temperature, "shard_size": shard_size,
            "seed": seed, "jobs_total": len(jobs), "responder": endpoint.describe() if endpoint else "local",
            "capture": capture,
            "part": list(part), "shards": [], "num_sequences": 0, "tokens": 0, "response_tokens": 0,
            "generate_s": 0.0, "capture_s": 0.0, "prompts_too_long": skipped}
    meta = _resume(out, meta)
    retokenized = meta.get("retokenized_responses", 0)  # earlier sessions' (an endpoint counts its own)
    n_shards = (len(jobs) + shard_size - 1) // shard_size
    mine = [i for i in range(n_shards) if i % part[1] == part[0]]
    todo = [i for i in mine if i not in set(meta["shards"]) or not (out / shard_name(i)).exists()]
    size = lambda i: min(shard_size, len(jobs) - i * shard_size)  # noqa: E731
    bar = tqdm(total=sum(map(size, mine)), initial=sum(map(size, mine)) - sum(map(size, todo)), desc="train data",
               unit="seq", disable=not progress)
    record = tuple(sorted({*layers, model.cfg.num_layers})) if capture == "generation" else ()
    t0 = time.perf_counter()
    shards = _shards_done(llm, endpoint, jobs, todo, shard_size, max_tokens, temperature, seed, record)
    with closing(shards):
        for i, responses, recorded in shards:
            t1 = time.perf_counter()
            chunk = jobs[i * shard_size : (i + 1) * shard_size]
            _write(out, i, model, [p["ids"] for p, _ in chunk], responses, recorded, layers, meta)
            meta["generate_s"] = round(meta["generate_s"] + t1 - t0, 1)
            meta["capture_s"] = round(meta["capture_s"] + time.perf_counter() - t1, 1)
            if endpoint is not None and endpoint.retokenized:
                meta["retokenized_responses"] = retokenized + endpoint.retokenized
            write_meta(out, meta)
            bar.update(len(chunk))
            t0 = time.perf_counter()  # generating goes on from here (the engine is fed across shards)
    bar.close()
    return meta


def _write(out: Path, i: int, model, prompts: list[list[int]], responses: list[list[int]], recorded: list | None,
           layers: list[int], meta: dict) -> None:
    """Shard i from its prompts and responses: the states recorded while generating, or a batched prefill now;
    `meta` counts it (the caller writes meta.json after the shard)."""
    from verispec.execution.features import capture_many

    full = [p + r for p, r in zip(prompts, responses)]
    if recorded is not None:
        states = _recorded(model, full, recorded, layers)
    else:
        states = [(ids, h, last) for ids, (h, last) in zip(full, capture_many(model, full, layers))]
    seqs = [(ids, len(p), {k: h[k].float() for k in layers}, last.float())
            for (ids, h, last), p in zip(states, prompts)]
    write_shard(out / shard_name(i), seqs)
    meta["shards"] = sorted(set(meta["shards"]) | {i})
    meta["num_sequences"] += len(seqs)
    meta["tokens"] += sum(len(ids) for ids, *_ in seqs)
    meta["response_tokens"] += sum(len(ids) - plen for ids, plen, *_ in seqs)


def merge_parts(out_dir: str, parts: list[str]) -> dict:
    """Join the directories of a data run split over machines (`--part i/n`) into one: the settings must agree,
    each shard comes from one part only; shards are hard-linked where the file system allows, else copied. Parts
    may differ in capture mode: every shard holds the states at exactly the positions its sequences keep (a
    generation-captured response leaves out its last, never-fed token), so their sequences mix; the joined
    directory's capture is then "mixed", and it is not extended by `train data` (write a new part and merge)."""
    metas = [read_meta(p) for p in parts]
    diff = sorted({k for m in metas[1:] for k in _FIXED if k != "capture" and m.get(k, _DEFAULTS.get(k)) !=
                   metas[0].get(k, _DEFAULTS.get(k))})
    if diff:
        raise ValueError(f"the parts were made with different settings ({', '.join(diff)}): they are not one data set")
    owner: dict[int, str] = {}
    for p, m in zip(parts, metas):
        for s in m["shards"]:
            if s in owner:
                raise ValueError(f"shard {s} is in both {owner[s]} and {p}")
            owner[s] = p
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for s, p in owner.items():
        dst = out / shard_name(s)
        if not dst.exists():
            link_shard(Path(p) / shard_name(s), dst)
    captures = {m.get("capture", _DEFAULTS["capture"]) for m in metas}
    meta = {**metas[0], "shards": sorted(owner), "part": [0, 1], "merged_from": [str(p) for p in parts],
            "capture": captures.pop() if len(captures) == 1 else MIXED}
    for k in ("num_sequences", "tokens", "response_tokens", "generate_s", "capture_s"):
        meta[k] = round(sum(m.get(k, 0) for m in metas), 1)
    write_meta(out, meta)
    return meta


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="the target (known name, .gguf, HF directory)")
    p.add_argument("--out", required=True, help="data directory (resumed if it exists)")
    p.add_argument("--prompts", nargs="*", default=[], help="extra prompt files (JSONL: turns / prompt / messages)")
    p.add_argument("--per-file", type=int, default=None, help="use at most this many prompts of each file")
    p.add_argument("--no-project-prompts", action="store_true", help="leave out verispec's own training prompts")
    p.add_argument("--format-prompts", action="store_true", help="add verispec's larger format corpus (about 850 "
                   "prompts: JSON, templates, configs, Markdown, code in several languages, questions)")
    p.add_argument("--modes", default="greedy,sampled", help="comma list of greedy / sampled responses per prompt")
    p.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled responses")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--shard-size", type=int, default=32, help="sequences per shard")
    p.add_argument("--layers", default=None, help="comma list of target layers to capture (default: all drafters')")
    p.add_argument("--dtype", default="auto", help="the target's execution path while generating and capturing "
                   "(auto: the fastest measured, as `serve` runs it; the drafters then learn the states they will "
                   "read at run time)")
    p.add_argument("--max-num-seqs", type=int, default=48, help="requests generated at once (48 on a 2-core CPU: "
                   "fp32 106 vs 66 tok/s at 16; gguf-q8act 195 greedy / 175 sampled)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts in all (quick runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--endpoint", default=None, help="take the responses from this OpenAI-compatible server of the "
                   "same target (vLLM, SGLang, verispec serve); hidden states are still computed here")
    p.add_argument("--served-model", default=None, help="the model id on --endpoint (default: the only one)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight to --endpoint")
    p.add_argument("--capture", default="auto", choices=CAPTURES, help="generation: record the hidden states "
                   "as the target generates (no second pass; the last token of each response, never fed, is left "
                   "out); prefill: recompute them in a batched prefill afterwards (always with --endpoint); auto: "
                   "a resumed directory's own, else generation locally")
    p.add_argument("--part", default="0/1", help="I/N: write only shards s with s %% N == I (N machines, one part "
                   "each, into their own --out; join them with `verispec train merge-data`)")


def parse_part(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--part takes I/N (e.g. 0/4), got {text!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"--part {text}: needs 0 <= I < N")
    return i, n


def run(args: argparse.Namespace) -> dict:
    from verispec import LLM

    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    bad = [m for m in modes if m not in ("greedy", "sampled")]
    if bad or not modes:
        raise ValueError(f"--modes takes greedy and/or sampled, got {args.modes!r}")
    prompts = collect_prompts(args.prompts, args.per_file, not args.no_project_prompts, formats=args.format_prompts)
    if args.limit is not None:
        prompts = prompts[: args.limit]
    sources = (["verispec.train.corpus"] if not args.no_project_prompts else []) + \
        (["verispec.train.corpus_formats"] if args.format_prompts else []) + [Path(f).name for f in args.prompts]
    if args.per_file is not None:
        sources.append(f"per_file={args.per_file}")
    if args.limit is not None:
        sources.append(f"limit={args.limit}")
    part = parse_part(args.part)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_model_len=2048)
    endpoint = None
    if args.endpoint:
        from verispec.train.endpoint import Endpoint

        endpoint = Endpoint.connect(args.endpoint, args.served_model, tokenizer=llm.tokenizer,
                                    concurrency=args.concurrency)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    return generate_data(llm, args.out, prompts, sources=sources, modes=modes, max_tokens=args.max_tokens,
                         temperature=args.temperature, shard_size=args.shard_size, seed=args.seed, layers=layers,
                         endpoint=endpoint, part=part, capture=args.capture)
