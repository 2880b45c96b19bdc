"""`verispec doctor`: run the chain checkpoint -> runtime class -> drafter -> method -> target interface ->
verifier / scheduler -> greedy identity -> state oracle, link by link; stop at the first broken link and say which
later links were skipped. Prints a table (or JSON); exit 0 when every link passes, 1 when one fails."""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from verispec.config import DEFAULT_NUM_SPECULATIVE_TOKENS, LEARNED_METHODS, SPEC_METHODS, ModelConfig
from verispec.doctor import checks as C
from verispec.doctor import interface as I

STAGES = ("target architecture", "drafter architecture", "drafter config fields", "speculative method",
          "hidden-state interface", "drafter implementation", "verifier and scheduler", "greedy identity",
          "state oracle")
PROMPTS = ("The capital of France is", "def fibonacci(n):", "List three colours:")
FALLBACK_IDS = ((1, 5, 9, 13), (2, 7, 7, 3, 11), (4, 8, 15, 16, 23))  # targets without a tokenizer


@dataclass(frozen=True)
class DoctorOptions:
    model: str
    method: str = "eagle3"
    drafter: str | None = None
    scheduler: str = "dspark"
    dtype: str = "float32"
    max_tokens: int = 16  # per identity prompt
    state_steps: int = 32  # decode steps under the state oracle
    k: int = DEFAULT_NUM_SPECULATIVE_TOKENS


@dataclass
class Ctx:
    """What the links found so far (filled as the chain runs)."""

    opts: DoctorOptions
    target_cfg: dict[str, Any] = field(default_factory=dict)
    target: ModelConfig | None = None
    resolved: Any = None
    drafter_dir: Path | None = None
    raw: dict[str, Any] = field(default_factory=dict)
    kind: str | None = None
    llm: Any = None
    spec_dir: str | None = None  # what speculative_config["model"] gets
    tmp: Any = None


def _target(ctx: Ctx) -> list[C.Check]:
    from verispec.models.loader import read_config, resolve

    ctx.resolved = resolve(ctx.opts.model, progress=False)
    ctx.target_cfg = read_config(ctx.resolved.directory)
    check = C.target_route(ctx.target_cfg)
    if check.ok and ctx.resolved.gguf is not None:  # which of its formats run on native kernel bodies
        from verispec.models.gguf_blocks import KERNEL_FORMATS
        from verispec.models.quantized import dense_fallbacks, fallback_note, linear_formats

        fallbacks = dense_fallbacks(ctx.resolved.gguf)
        formats = C.weight_formats(linear_formats(ctx.resolved.gguf), tuple(KERNEL_FORMATS),
                                   fallback_note(fallbacks) if fallbacks else "")
        check = C.passed(check.name, f"{check.detail}; {formats}")
    if check.ok:
        try:
            ctx.target = ModelConfig.from_hf(ctx.target_cfg)
        except (KeyError, ValueError) as e:
            return [C.failed(check.name, check.detail, f"config.json does not build a decoder: {e}")]
    return [check]


def _drafter_dir(ctx: Ctx) -> Path:
    from verispec.drafters.shipped import resolve, shipped_for
    from verispec.models import hub

    given = ctx.opts.drafter
    if given is None:
        known = hub.lookup_known(ctx.opts.model)
        given = shipped_for(ctx.opts.method, known.name) if known is not None else None
        if given is None:
            raise ValueError(f"method {ctx.opts.method} needs --drafter DIR: no drafter is shipped for "
                             f"{ctx.opts.model}")
    return resolve(given)


def _drafter(ctx: Ctx) -> list[C.Check]:
    o = ctx.opts
    if o.method == "mtp":  # the target's own checkpoint drafts
        from verispec.models.loader import tensor_index

        return [C.mtp_layout(ctx.target_cfg, set(tensor_index(ctx.resolved.directory)))]
    if o.method not in LEARNED_METHODS:
        if o.method == "draft_model":
            from verispec.models.loader import read_config, resolve

            ctx.drafter_dir = resolve(o.drafter, progress=False).directory  # type: ignore[arg-type]
            ctx.raw = read_config(ctx.drafter_dir)
            ctx.spec_dir = str(ctx.drafter_dir)
            c = C.target_route(ctx.raw)
            return [C.Check("drafter architecture", c.ok, c.detail, c.reason)]
        return [C.passed("drafter architecture", f"none: {o.method} drafts without a checkpoint")]
    try:
        ctx.drafter_dir = _drafter_dir(ctx)
        ctx.raw = json.loads((ctx.drafter_dir / "config.json").read_text())
    except (FileNotFoundError, ValueError) as e:
        return [C.failed("drafter architecture", str(o.drafter), str(e))]
    ctx.kind = C.drafter_kind(ctx.raw)
    ctx.spec_dir = str(ctx.drafter_dir)
    return [C.drafter_route(ctx.raw, o.method)]


def _fields(ctx: Ctx) -> list[C.Check]:
    if ctx.kind is None:
        return [C.passed("drafter config fields", "no learned checkpoint")]
    return [C.config_fields(ctx.raw, ctx.kind)]


def _method(ctx: Ctx) -> list[C.Check]:
    return [C.method_link(ctx.opts.method, ctx.kind)]


def _vocab_of(directory: Path | None) -> dict[str, int] | None:
    from verispec.models.loader import ResolvedModel, load_tokenizer

    if directory is None:
        return None
    tok = load_tokenizer(ResolvedModel(str(directory), directory))
    return None if tok is None else tok.get_vocab()


def _maps(ctx: Ctx):
    from safetensors import safe_open

    assert ctx.drafter_dir is not None
    with safe_open(str(ctx.drafter_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        return tuple(f.get_tensor(k) if k in keys else None for k in ("d2t", "t2d"))


def _interface(ctx: Ctx) -> list[C.Check]:
    assert ctx.target is not None
    target_vocab = _vocab_of(ctx.resolved.directory)
    if ctx.opts.method == "draft_model":
        d = ModelConfig.from_hf(ctx.raw)
        f = I.DrafterFacts((), ctx.target.hidden_size, d.vocab_size, ctx.target.head_dim)
        return [I.vocabulary(f, ctx.target), I.tokenizer(target_vocab, _vocab_of(ctx.drafter_dir))]
    if ctx.opts.method == "mtp":
        return [C.passed("hidden-state interface", f"mtp reads the target's own last layer (layer "
                                                   f"{ctx.target.num_layers}), shapes from the same checkpoint")]
    if ctx.kind is None:
        return [C.passed("hidden-state interface", f"{ctx.opts.method} reads no hidden states")]
    f = I.facts(ctx.raw, ctx.kind)
    maps = _maps(ctx) if ctx.kind.startswith("eagle3") else None
    return I.all_checks(f, ctx.target, maps, target_vocab, _vocab_of(ctx.drafter_dir))


def _implementation(ctx: Ctx) -> list[C.Check]:
    from verispec import LLM

    o = ctx.opts
    name = "drafter implementation"
    if ctx.kind == "eagle3-export":
        from verispec.doctor.eagle3_import import import_export

        ctx.tmp = tempfile.TemporaryDirectory(prefix="verispec-doctor-")
        try:
            ctx.spec_dir = str(import_export(ctx.drafter_dir, Path(ctx.tmp.name) / "head"))  # type: ignore[arg-type]
        except (KeyError, ValueError) as e:
            return [C.failed(name, "LlamaForCausalLMEagle3 export", str(e))]
    ctx.llm = LLM(o.model, dtype=o.dtype, progress=False, scheduler=o.scheduler, max_num_seqs=len(PROMPTS),
                  max_model_len=min(512, ctx.target.max_position_embeddings))  # type: ignore[union-attr]
    try:
        spec = ctx.llm.with_speculation(_spec(ctx))
    except Exception as e:  # noqa: BLE001 - any construction error is this link's reason
        return [C.failed(name, f"loading {ctx.spec_dir or o.method}", " ".join(f"{type(e).__name__}: {e}".split()))]
    learned = spec.drafters.learned
    what = type(learned).__module__ + "." + type(learned).__name__ if learned is not None else o.method
    if learned is not None:
        n = sum(p.numel() for p in learned.parameters())
        return [C.passed(name, f"{what}: {n:,} parameters loaded, shapes match the config")]
    return [C.passed(name, f"{what}: constructed")]


def _spec(ctx: Ctx) -> dict[str, Any] | None:
    o = ctx.opts
    if o.method == "none":
        return None
    spec: dict[str, Any] = {"method": o.method, "num_speculative_tokens": o.k}
    if ctx.spec_dir is not None:
        spec["model"] = ctx.spec_dir
    return spec


def _scheduler(ctx: Ctx) -> list[C.Check]:
    temps = (ctx.raw.get("verispec_config") or {}).get("confidence_temperatures")
    return [C.scheduler_link(ctx.opts.scheduler, ctx.opts.method, calibrated=bool(temps) or ctx.kind != "dspark")]


def _prompt_ids(ctx: Ctx) -> list[list[int]]:
    tok = ctx.llm.tokenizer
    if tok is None:
        return [list(p) for p in FALLBACK_IDS]
    return [tok.encode(p) for p in PROMPTS]


def _identity(ctx: Ctx) -> list[C.Check]:
    from verispec import SamplingParams
    from verispec.check.identity import compare_greedy

    name = "greedy identity"
    params = SamplingParams(temperature=0, max_tokens=ctx.opts.max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in _prompt_ids(ctx)]
    plain = ctx.llm.with_speculation(None).generate(prompts, params, use_tqdm=False)
    spec = ctx.llm.with_speculation(_spec(ctx)).generate(prompts, params, use_tqdm=False)
    ties = []
    for i, (p, s) in enumerate(zip(plain, spec)):
        div = compare_greedy(ctx.llm.model, p.prompt_token_ids, p.token_ids, s.token_ids)
        if div is not None and not div.near_tie:
            return [C.failed(name, f"prompt {i}", f"speculation on != off: {div}")]
        if div is not None:
            ties.append(f"prompt {i}: {div}")
    n = sum(len(p.token_ids) for p in plain)
    tau = sum(s.stats.get("mean_acceptance_length", 0.0) for s in spec) / len(spec)
    note = f"; near-ties only: {'; '.join(ties)}" if ties else ""
    invariant = ("batch-invariant: on == off bitwise" if ctx.llm.model.batch_invariant else
                 "NOT batch-invariant on this machine: on == off only up to near-ties")
    return [C.passed(name, f"{len(prompts)} prompts x {ctx.opts.max_tokens} tokens: on == off ({n} tokens), "
                     f"tau {tau:.2f}; path {ctx.llm.path_choice.path.name}, {invariant}{note}")]


def _state(ctx: Ctx) -> list[C.Check]:
    from verispec import SamplingParams
    from verispec.check.state import StateMismatch

    name = "state oracle"
    llm = ctx.llm.with_speculation(_spec(ctx), check_state=True)
    params = SamplingParams(temperature=0, max_tokens=ctx.opts.state_steps, ignore_eos=True)
    try:
        out = llm.generate([{"prompt_token_ids": _prompt_ids(ctx)[0]}], params, use_tqdm=False)[0]
    except (StateMismatch, AssertionError) as e:
        return [C.failed(name, "check_state=True", str(e))]
    return [C.passed(name, f"target KV and drafter state equal a from-scratch recomputation after each of "
                     f"{out.stats.get('steps', '?')} steps ({len(out.token_ids)} tokens)")]


LINKS: tuple[Callable[[Ctx], list[C.Check]], ...] = (_target, _drafter, _fields, _method, _interface,
                                                    _implementation, _scheduler, _identity, _state)
assert len(LINKS) == len(STAGES)


@dataclass(frozen=True)
class Report:
    checks: tuple[C.Check, ...]
    skipped: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks) and not self.skipped


def run_doctor(opts: DoctorOptions) -> Report:
    ctx = Ctx(opts)
    done: list[C.Check] = []
    try:
        for i, link in enumerate(LINKS):
            got = link(ctx)
            done += got
            if not all(c.ok for c in got):
                return Report(tuple(done), STAGES[i + 1:])
        return Report(tuple(done), ())
    finally:
        if ctx.tmp is not None:
            ctx.tmp.cleanup()


def format_table(r: Report) -> str:
    w = max(len(c.name) for c in r.checks)
    lines = []
    for c in r.checks:
        lines.append(f"{'ok  ' if c.ok else 'FAIL'}  {c.name:<{w}}  {c.detail}")
        if not c.ok:
            lines.append(f"{'':4}  {'':<{w}}  reason: {c.reason}")
    lines += [f"skip  {s:<{w}}  not run: an earlier link failed" for s in r.skipped]
    lines.append("doctor: all links pass" if r.ok else "doctor: the chain is broken (see FAIL)")
    return "\n".join(lines)


def add_doctor_args(p: argparse.ArgumentParser) -> None:
    from verispec.models.hub import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="the target (known name, .gguf, HF dir)")
    p.add_argument("--drafter", default=None, help="drafter checkpoint dir or shipped name (default: the shipped "
                   "one for the target), an exported LlamaForCausalLMEagle3 dir, or a draft model")
    p.add_argument("--method", default="eagle3", choices=SPEC_METHODS)
    p.add_argument("--scheduler", default=DoctorOptions.scheduler, choices=("static", "goodput", "dspark"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per identity prompt")
    p.add_argument("--state-steps", type=int, default=32, help="tokens generated under the state oracle")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")


def run_doctor_cli(args: argparse.Namespace) -> int:
    if args.max_tokens < 1 or args.state_steps < 1:
        raise ValueError("--max-tokens and --state-steps must be positive")
    if args.method == "draft_model" and not args.drafter:
        raise ValueError("--method draft_model needs --drafter (the draft model)")
    opts = DoctorOptions(args.model, args.method, args.drafter, args.scheduler, args.dtype, args.max_tokens,
                         args.state_steps)
    report = run_doctor(opts)
    if args.json:
        print(json.dumps({"ok": report.ok, "checks": [asdict(c) for c in report.checks],
                          "skipped": list(report.skipped)}, indent=1))
    else:
        print(format_table(report))
    return 0 if report.ok else 1
