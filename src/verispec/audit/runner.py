"""Generate both sides of an audit on the same prompts and seeds, grade every output, keep every raw record.

A side is our engine in process (`EngineSide`: chat template -> prompt ids -> `LLM.generate`, batched) or an
OpenAI-compatible endpoint (`EndpointSide`: /v1/chat/completions with seed, temperature and max_tokens, a bounded
number of requests in flight). An item whose check has "tools" (the agent domain) is run with them as real tools,
tool_choice "auto": in process rendered and parsed as `LLM.chat(..., tools=...)` does (verispec/tools.py), over an
endpoint in the request body (dropped for the rest of the run where the endpoint answers 400 naming them); its
record keeps the parsed `tool_calls`, which the agent grader grades where there are any. A job is one item at one temperature with one sample index; its seed is derived
from the item id and the sample, so both sides (and a rerun) get the same one. At temperature 0 one sample is
taken (greedy decoding is deterministic); `samples` applies to temperatures above 0.
"""

from __future__ import annotations

import asyncio
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from tqdm.auto import tqdm

from verispec.audit.items import AuditItem
from verispec.audit.spec import AUDIT_MAX_NUM_SEQS, EndpointSpec, EngineSpec, Spec

Grader = Callable[..., Any]  # (item, text[, tool_calls]) -> Grade(score, passed, details)
SIDES = ("reference", "candidate")
# per-request engine counters kept in each in-process record's "engine" field (the sweep sums them)
ENGINE_COUNTERS = ("steps", "num_draft_tokens", "num_accepted_tokens", "num_relaxed_accepted_tokens", "tv_positions",
                   "tv_mean")


@dataclass(frozen=True)
class Job:
    item: AuditItem
    temperature: float
    sample: int
    seed: int
    max_tokens: int


@dataclass
class Generation:
    text: str
    token_ids: list[int] | None  # None where the side does not report them
    finish_reason: str | None = None
    prompt_ids: list[int] | None = None
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI tool calls, where the item was run with tools


def item_tools(item: AuditItem) -> list[dict[str, Any]] | None:
    """An item's tools as OpenAI's request gives them, where its check has "tools" (the agent domain's
    `{"name", "description", "parameters"}` each); else None."""
    check = item.check if isinstance(item.check, dict) else {}
    tools = check.get("tools")
    return [{"type": "function", "function": dict(t)} for t in tools] if isinstance(tools, list) and tools else None


class Side(Protocol):
    def describe(self) -> str: ...

    def generate(self, jobs: Sequence[Job], progress: bool, desc: str) -> list[Generation]: ...


def job_seed(item_id: str, sample: int, base_seed: int = 0) -> int:
    """The seed of one (item, sample), the same on both sides and across runs."""
    return (zlib.crc32(f"{item_id}/{sample}".encode()) + base_seed) % 2**31


def make_jobs(items: Sequence[AuditItem], temperatures: Sequence[float], samples: int, base_seed: int = 0,
              max_tokens: int | None = None) -> list[Job]:
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if not temperatures or any(t < 0 for t in temperatures):
        raise ValueError(f"temperatures must be >= 0, got {list(temperatures)}")
    jobs = []
    for t in temperatures:
        for item in items:
            for s in range(1 if t == 0 else samples):
                cap = item.max_tokens if max_tokens is None else min(item.max_tokens, max_tokens)
                jobs.append(Job(item, float(t), s, job_seed(item.id, s, base_seed), cap))
    return jobs


# ---- our engine, in process ----------------------------------------------------------------------------------------

class EngineSide:
    """One engine configuration over a loaded LLM; prompts go through the model's chat template."""

    def __init__(self, llm: Any, spec: EngineSpec, batch: int | None = None) -> None:
        self.llm, self.spec = llm, spec
        self.batch = batch or max(8, llm.max_num_seqs)

    def describe(self) -> str:
        return f"{self.spec.describe()} (path {self.llm.path_choice.path.name})"

    def prompt_ids(self, item: AuditItem) -> list[int]:
        """The chat prompt's ids; an item with tools rendered with them as LLM.chat renders them (tool_choice auto)."""
        from verispec.tools import render, tool_spec

        spec = tool_spec(item_tools(item))
        messages = list(item.messages)
        text = self.llm.apply_chat_template(messages) if spec is None else render(self.llm, messages, spec)
        return list(self.llm.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(self, jobs: Sequence[Job], progress: bool, desc: str) -> list[Generation]:
        from verispec import SamplingParams
        from verispec.tools import parse_output

        ids = {}
        for j in jobs:
            if j.item.id not in ids:
                ids[j.item.id] = self.prompt_ids(j.item)
        out: list[Generation] = []
        bar = tqdm(total=len(jobs), desc=desc, disable=not progress, file=sys.stderr)
        for start in range(0, len(jobs), self.batch):
            chunk = jobs[start:start + self.batch]
            cut = self.spec.truncate or 10**9  # a degraded candidate keeps only its first `truncate` tokens
            params = [SamplingParams(temperature=j.temperature, max_tokens=min(j.max_tokens, cut), seed=j.seed)
                      for j in chunk]
            res = self.llm.generate([{"prompt_token_ids": ids[j.item.id]} for j in chunk], params, use_tqdm=False)
            for j, r in zip(chunk, res):
                s = r.stats
                out.append(Generation(r.text, list(r.token_ids), r.finish_reason, ids[j.item.id], stats={
                    "tau": s.get("mean_acceptance_length"), "lossy": s.get("lossy"), "path": s.get("path"),
                    **{k: s.get(k) for k in ENGINE_COUNTERS}},
                    tool_calls=parse_output(r.text)[1] if item_tools(j.item) else None))
            bar.update(len(chunk))
        bar.close()
        return out


def build_engine_sides(specs: Sequence[EngineSpec], model: str, device: str | None = None,
                       max_model_len: int | None = None, max_num_seqs: int = AUDIT_MAX_NUM_SEQS,
                       progress: bool = True) -> list[EngineSide]:
    """One EngineSide per spec; specs on the same target, dtype and weight format share one loaded LLM."""
    from verispec import LLM

    loaded: dict[tuple, Any] = {}
    sides = []
    for spec in specs:
        key = spec.weights_key(model)
        if key in loaded:
            llm = loaded[key].with_speculation(spec.speculative_config())  # a copy: its own drafters and engine
            llm.scheduler = spec.scheduler  # not the first spec's (None: the LLM's default for the method)
        else:
            llm = LLM(key[0], dtype=spec.dtype, device=device, max_model_len=max_model_len, progress=progress,
                      speculative_config=spec.speculative_config(), max_num_seqs=max_num_seqs,
                      scheduler=spec.scheduler, quantization=spec.quantization, invariant=spec.invariant)
            loaded[key] = llm
        if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
            raise ValueError(f"{key[0]} has no tokenizer with a chat template: audit items are chat messages")
        sides.append(EngineSide(llm, spec))
    return sides


# ---- an OpenAI-compatible endpoint ---------------------------------------------------------------------------------

class EndpointSide:
    """/v1/chat/completions, non-streaming, at most `concurrency` requests in flight. Token ids where the server
    takes verispec's / vLLM's `return_token_ids` (else None); failed requests are recorded, not raised."""

    RETRY_STATUS = (429, 500, 502, 503, 504)

    def __init__(self, spec: EndpointSpec, concurrency: int = 8, timeout: float = 600.0, retries: int = 2) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.spec, self.concurrency, self.timeout, self.retries = spec, concurrency, timeout, retries
        self.token_ids = True  # dropped after the first 400 that names it
        self.tools = True  # items' tools sent; dropped after the first 400 that names them (free text then)
        self.model = spec.model

    def describe(self) -> str:
        return self.spec.describe() if self.spec.model or not self.model else f"{self.spec.describe()} ({self.model})"

    def generate(self, jobs: Sequence[Job], progress: bool, desc: str) -> list[Generation]:
        return asyncio.run(self._run(list(jobs), progress, desc))

    async def _run(self, jobs: list[Job], progress: bool, desc: str) -> list[Generation]:
        import httpx

        from verispec.bench.client import base_url

        headers = {"Authorization": f"Bearer {self.spec.key}"} if self.spec.key else {}
        async with httpx.AsyncClient(base_url=base_url(self.spec.url), headers=headers,
                                     timeout=httpx.Timeout(self.timeout, connect=30.0)) as http:
            if not self.model:
                self.model = await self._first_model(http)
            sem = asyncio.Semaphore(self.concurrency)
            bar = tqdm(total=len(jobs), desc=desc, disable=not progress, file=sys.stderr)

            async def one(job: Job) -> Generation:
                async with sem:
                    g = await self._request(http, job)
                bar.update()
                return g

            try:
                return list(await asyncio.gather(*(one(j) for j in jobs)))
            finally:
                bar.close()

    async def _first_model(self, http: Any) -> str:
        r = await http.get("/v1/models")
        if r.status_code != 200:
            raise ValueError(f"{self.spec.url}: GET /v1/models answered HTTP {r.status_code}; give model=NAME "
                             "(and key=... if it needs one)")
        ids = [m.get("id") for m in r.json().get("data", [])]
        if not ids:
            raise ValueError(f"{self.spec.url}/v1/models lists no model: give model=NAME in the SPEC")
        return ids[0]

    def body(self, job: Job) -> dict[str, Any]:
        b = {"model": self.model, "messages": [dict(m) for m in job.item.messages], "max_tokens": job.max_tokens,
             "temperature": job.temperature, "seed": job.seed, "stream": False}
        if self.token_ids:
            b["return_token_ids"] = True
        tools = item_tools(job.item) if self.tools else None
        if tools:
            b["tools"], b["tool_choice"] = tools, "auto"
        return b

    async def _request(self, http: Any, job: Job) -> Generation:
        import httpx

        error = "no attempt made"
        for attempt in range(self.retries + 1):
            try:
                r = await http.post("/v1/chat/completions", json=self.body(job))
            except httpx.HTTPError as e:
                error = f"{type(e).__name__}: {e}"
                await asyncio.sleep(0.5 * 2**attempt)
                continue
            if r.status_code == 400 and self.token_ids and "return_token_ids" in r.text:
                self.token_ids = False
                r = await http.post("/v1/chat/completions", json=self.body(job))
            if r.status_code == 400 and self.tools and item_tools(job.item) and "tool" in r.text:
                self.tools = False
                r = await http.post("/v1/chat/completions", json=self.body(job))
            if r.status_code in (401, 403, 404):
                raise ValueError(f"{self.spec.url}: /v1/chat/completions answered HTTP {r.status_code}: "
                                 f"{r.text[:200]} (check url=, model= and key=)")
            if r.status_code in self.RETRY_STATUS:
                error = f"http_{r.status_code}: {r.text[:200]}"
                await asyncio.sleep(0.5 * 2**attempt)
                continue
            if r.status_code != 200:
                return Generation("", None, error=f"http_{r.status_code}: {r.text[:300]}")
            return _parse_choice(r)
        return Generation("", None, error=error)


def _parse_choice(r: Any) -> Generation:
    try:
        body = r.json()
        ch = body["choices"][0]
        text = (ch.get("message") or {}).get("content") or ""
        calls = (ch.get("message") or {}).get("tool_calls")
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return Generation("", None, error=f"malformed response ({type(e).__name__}): {r.text[:200]}")
    ids = ch.get("token_ids")
    ids = [int(t) for t in ids] if isinstance(ids, list) else None
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    n = usage.get("completion_tokens")  # output tokens where the server gives no token ids (the sweep's tok/s)
    return Generation(text, ids, ch.get("finish_reason"), stats={"completion_tokens": n} if isinstance(n, int) else {},
                      tool_calls=calls if isinstance(calls, list) and calls else None)


def build_sides(candidate: Spec, reference: Spec, model: str, device: str | None = None,
                max_model_len: int | None = None, max_num_seqs: int = AUDIT_MAX_NUM_SEQS,
                concurrency: int = AUDIT_MAX_NUM_SEQS,
                progress: bool = True) -> tuple[Side, Side]:
    """(candidate, reference) sides; in-process specs on the same target weights share one loaded LLM."""
    specs = {"candidate": candidate, "reference": reference}
    engine = [n for n, s in specs.items() if isinstance(s, EngineSpec)]
    built = build_engine_sides([specs[n] for n in engine], model, device, max_model_len, max_num_seqs, progress)
    sides: dict[str, Side] = dict(zip(engine, built))
    for n, s in specs.items():
        if isinstance(s, EndpointSpec):
            sides[n] = EndpointSide(s, concurrency)
    return sides["candidate"], sides["reference"]


# ---- the audit -----------------------------------------------------------------------------------------------------

def _graded(grader: Grader, item: AuditItem, g: Generation) -> tuple[float, bool, dict[str, Any], str | None]:
    """(score, passed, details, error): a request error or a grader that raises makes the record an error."""
    if g.error is not None:
        return 0.0, False, {}, g.error
    try:
        gr = grader(item, g.text, g.tool_calls) if g.tool_calls else grader(item, g.text)
    except Exception as e:  # noqa: BLE001 - a broken check must not lose the generations; the pair is left out
        return 0.0, False, {}, f"grader: {type(e).__name__}: {e}"
    return float(gr.score), bool(gr.passed), dict(gr.details), None


def record(side: str, job: Job, g: Generation, grader: Grader, describe: str) -> dict[str, Any]:
    score, passed, details, error = _graded(grader, job.item, g)
    return {
        "item_id": job.item.id, "domain": job.item.domain, "side": side, "spec": describe,
        "temperature": job.temperature, "sample": job.sample, "seed": job.seed, "max_tokens": job.max_tokens,
        "text": g.text, "token_ids": g.token_ids, "tool_calls": g.tool_calls,
        "output_tokens": len(g.token_ids) if g.token_ids is not None else None, "finish_reason": g.finish_reason,
        "score": score, "passed": passed, "grade": details, "error": error,
        "tau": g.stats.get("tau"), "lossy": g.stats.get("lossy"), "margin": None, "near_tie": None,
        "engine": {k: g.stats[k] for k in ENGINE_COUNTERS if k in g.stats} or None,
    }


def add_margins(cand: list[dict[str, Any]], ref_gens: list[Generation], cand_gens: list[Generation],
                reference: Side, candidate: Side) -> None:
    """Greedy pairs that differ, both sides in process on the same target: the reference target's top-1/top-2
    logit margin at the first divergent token (check/identity.py), so near-ties are told apart from changes."""
    if not (isinstance(reference, EngineSide) and isinstance(candidate, EngineSide)):
        return
    if reference.spec.weights_key("")[0] != candidate.spec.weights_key("")[0]:
        return
    from verispec.check.identity import compare_greedy

    for rec, r, c in zip(cand, ref_gens, cand_gens):
        if rec["temperature"] != 0 or r.prompt_ids != c.prompt_ids or r.token_ids is None or c.token_ids is None:
            continue
        div = compare_greedy(reference.llm.model, r.prompt_ids, r.token_ids, c.token_ids)
        if div is not None:
            rec["margin"], rec["near_tie"] = div.margin, div.near_tie


def check_items(items: Sequence[AuditItem], grader: Grader) -> None:
    """Grade an empty output for every item before anything is generated: a grader never raises on bad output,
    so a ValueError here is a malformed item `check`, reported now rather than after the generation."""
    for item in items:
        try:
            grader(item, "")
        except ValueError as e:
            raise ValueError(f"audit item {item.id!r} ({item.domain}): {e}") from None


def run_audit(items: Sequence[AuditItem], candidate: Side, reference: Side, temperatures: Sequence[float] = (0.0,),
              samples: int = 1, seed: int = 0, max_tokens: int | None = None, grader: Grader | None = None,
              progress: bool = True) -> list[dict[str, Any]]:
    """Every job on both sides (the reference first), graded: one raw record per (side, item, temperature, sample)."""
    if grader is None:
        from verispec.audit.graders import grade as grader
    if not items:
        raise ValueError("no audit items")
    check_items(items, grader)
    jobs = make_jobs(items, temperatures, samples, seed, max_tokens)
    ref_gens = reference.generate(jobs, progress, "audit reference")
    cand_gens = candidate.generate(jobs, progress, "audit candidate")
    assert len(ref_gens) == len(cand_gens) == len(jobs)
    refs = [record("reference", j, g, grader, reference.describe()) for j, g in zip(jobs, ref_gens)]
    cands = [record("candidate", j, g, grader, candidate.describe()) for j, g in zip(jobs, cand_gens)]
    add_margins(cands, ref_gens, cand_gens, reference, candidate)
    return refs + cands
