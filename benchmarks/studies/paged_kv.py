"""The paged KV cache under load: memory at many concurrent requests, and prefix caching of a shared system prompt.

Part 1, memory (`--concurrency C --max-model-len L`): C requests (the shipped workloads, mixed, greedy) decode at
once in one engine whose context is L. Reported: the KV blocks in use at the peak and their bytes, bytes per
token, preemptions, against what one preallocated slot of L positions per request would have taken (C x L).
Part 2, prefix caching (`--sharing N --system-tokens S`): N requests share one system prompt of about S tokens,
each with its own question, run with prefix caching off and on, interleaved, `--repeats` times. Reported: the
prefix-cache hit rate (hit tokens / queried prompt tokens), median TTFT and wall time of each side, their ratio,
and whether the outputs are identical.

Conditions (MEASURE.md): concurrency as given (closed batch: every request submitted at once, `--max-num-seqs`
decoding together); metric: KV bytes at peak / TTFT (submission to first token) and wall time; baseline: the same
engine with one slot per request (part 1, computed) and prefix caching off (part 2, measured in the same run).

    python benchmarks/studies/paged_kv.py --concurrency 128 --max-model-len 4096 --sharing 32 --system-tokens 1000
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from verispec import LLM, SamplingParams
from verispec.bench.workloads import WORKLOADS, load_workload

RULES = [
    "Answer in plain English, in short paragraphs, and say so when you do not know.",
    "Prefer concrete examples over abstract descriptions; show numbers with their units.",
    "Never invent a citation, a product name, a price or a date that the user did not give you.",
    "When a question is ambiguous, state the reading you chose before answering it.",
    "Keep code samples minimal, runnable and commented; name the language of every code block.",
    "Summaries come first, details after; end with one sentence the user can act on.",
]


def system_prompt(llm: LLM, tokens: int) -> str:
    """A support-desk system prompt of about `tokens` tokens: numbered house rules, repeated with their numbers."""
    lines, i = ["You are the support assistant of a small software company. Follow these house rules."], 0
    while len(llm.tokenizer("\n".join(lines))["input_ids"]) < tokens:
        lines.append(f"Rule {i + 1}: {RULES[i % len(RULES)]}")
        i += 1
    return "\n".join(lines)


def ids_of(llm: LLM, messages: list[dict[str, str]]) -> list[int]:
    return llm.tokenizer(llm.apply_chat_template(messages), add_special_tokens=False)["input_ids"]


def memory_part(llm: LLM, conc: int, max_tokens: int) -> dict:
    sets = [load_workload(w) for w in WORKLOADS]
    prompts = [{"prompt_token_ids": ids_of(llm, list(sets[i % len(sets)][i // len(sets) % len(sets[i % len(sets)])]
                                                     .messages))} for i in range(conc)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.configure_engine(max_num_seqs=conc)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    cache = llm.cache
    per_block = cache.bytes_per_block()
    per_pos = per_block // cache.block_size
    tokens = sum(len(p["prompt_token_ids"]) + len(o.token_ids) for p, o in zip(prompts, outs))
    return {"concurrency": conc, "max_model_len": llm.max_model_len, "block_size": cache.block_size,
            "bytes_per_token": per_pos, "pool_blocks": cache.pool.num_blocks,
            "pool_bytes": cache.pool.num_blocks * per_block, "peak_blocks": cache.pool.peak_used,
            "peak_bytes": cache.pool.peak_used * per_block, "tokens_total": tokens,
            "slot_design_bytes": conc * llm.max_model_len * per_pos,
            "preemptions": llm.engine.num_preemptions, "output_tokens": sum(len(o.token_ids) for o in outs),
            "wall_s": wall}


def prefix_side(llm: LLM, prompts: list[dict], params: SamplingParams) -> dict:
    llm.engine  # built before the clock starts
    q0, h0 = llm.cache.prefix_queries, llm.cache.prefix_hits
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "ttft_s": statistics.median(o.stats["ttft_s"] for o in outs),
            "queries": llm.cache.prefix_queries - q0, "hits": llm.cache.prefix_hits - h0,
            "outputs": [o.token_ids for o in outs]}


def prefix_part(llm: LLM, sharing: int, system_tokens: int, seqs: int, repeats: int) -> dict:
    system = system_prompt(llm, system_tokens)
    questions = [f"Question {i + 1}: in two sentences, how should I {task}?" for i, task in enumerate(
        ["name a variable", "write a commit message", "report a bug", "ask for a refund", "structure a README",
         "choose a password", "back up a laptop", "review a pull request"] * (sharing // 8 + 1))][:sharing]
    prompts = [{"prompt_token_ids": ids_of(llm, [{"role": "system", "content": system},
                                                 {"role": "user", "content": q}])} for q in questions]
    params = SamplingParams(temperature=0, max_tokens=8)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for r in range(repeats):
        for side in (["off", "on"] if r % 2 == 0 else ["on", "off"]):
            llm.configure_engine(max_num_seqs=seqs, enable_prefix_caching=side == "on")
            if llm.cache.pool.num_used or llm.cache.pool.cached:  # every run starts from an empty cache
                llm.enable_prefix_caching = not llm.enable_prefix_caching
                llm.configure_engine(enable_prefix_caching=side == "on")
            runs[side].append(prefix_side(llm, prompts, params))
    on, off = runs["on"], runs["off"]
    return {"sharing": sharing, "system_tokens": len(ids_of(llm, [{"role": "system", "content": system}])),
            "max_num_seqs": seqs, "repeats": repeats,
            "hit_rate": sum(x["hits"] for x in on) / max(1, sum(x["queries"] for x in on)),
            "ttft_off_s": statistics.median(x["ttft_s"] for x in off),
            "ttft_on_s": statistics.median(x["ttft_s"] for x in on),
            "wall_off_s": statistics.median(x["wall_s"] for x in off),
            "wall_on_s": statistics.median(x["wall_s"] for x in on),
            "identical": all(a["outputs"] == b["outputs"] for a in on for b in off)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--sharing", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--prefix-seqs", type=int, default=8, help="max_num_seqs of the prefix-caching part")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, device="cpu", max_model_len=args.max_model_len, progress=False)
    print(f"path: {llm.path_choice.describe()}", flush=True)
    result: dict = {"path": llm.path_choice.as_dict()}
    if not args.skip_memory:
        m = result["memory"] = memory_part(llm, args.concurrency, args.max_tokens)
        gib = 1 << 30
        print(f"memory: {m['concurrency']} requests at context {m['max_model_len']}: peak {m['peak_blocks']} blocks "
              f"= {m['peak_bytes'] / gib:.2f} GiB ({m['bytes_per_token']} B/token, {m['tokens_total']} tokens "
              f"in all); one slot per request would take {m['slot_design_bytes'] / gib:.1f} GiB; pool "
              f"{m['pool_bytes'] / gib:.2f} GiB; {m['preemptions']} preemptions; {m['output_tokens']} output "
              f"tokens in {m['wall_s']:.1f} s", flush=True)
    p = result["prefix"] = prefix_part(llm, args.sharing, args.system_tokens, args.prefix_seqs, args.repeats)
    print(f"prefix caching: {p['sharing']} requests share {p['system_tokens']} system tokens: hit rate "
          f"{p['hit_rate']:.1%}; median TTFT off {p['ttft_off_s']:.2f} s, on {p['ttft_on_s']:.2f} s "
          f"(x{p['ttft_off_s'] / p['ttft_on_s']:.2f} faster); wall off {p['wall_off_s']:.1f} s, on "
          f"{p['wall_on_s']:.1f} s; outputs identical: {p['identical']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
