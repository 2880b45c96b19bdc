"""`verispec train data | merge-data | mix-data | eagle3 | dflash | dspark | selector | curve | draft-vocab |
export-eagle3 | export-dflash`."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def add_train_parser(sub) -> None:
    train = sub.add_parser("train", help="train drafters: self-distillation data, EAGLE-3, DFlash, DSpark")
    tsub = train.add_subparsers(dest="train_command", required=True)
    from verispec.train import data

    data.add_args(tsub.add_parser("data", help="the target answers a prompt corpus; its hidden states are captured "
                                               "into sharded safetensors (resumable)"))
    m = tsub.add_parser("merge-data", help="join the data directories of a run split with --part I/N")
    m.add_argument("out", help="directory for the joined data")
    m.add_argument("parts", nargs="+", help="the parts' directories")
    x = tsub.add_parser("mix-data", help="join different data sets of the same target into one training directory "
                                         "(shards linked, not copied)")
    x.add_argument("out", help="new directory for the mixed data")
    x.add_argument("sets", nargs="+", help="the data directories, in the order their shards are numbered")
    from verispec.train import eagle3

    e = tsub.add_parser("eagle3", help="train an EAGLE-3 head (TTT unroll, reduced draft vocabulary)")
    _target_args(e)
    e.add_argument("--device", default=None, help="default: cuda if available, else cpu (under torchrun: each "
                   "rank's own GPU)")
    eagle3.add_args(e)
    e.add_argument("--quick", action="store_true", help="a tiny, short run that proves the pipeline (CI)")
    from verispec.train import dflash

    for method in ("dflash", "dspark"):
        p = tsub.add_parser(method, help=f"train a {'DSpark' if method == 'dspark' else 'DFlash'} block drafter")
        dflash.add_args(p, method)
    from verispec.train import selector

    selector.add_args(tsub.add_parser("selector", help="train DFlash 2's path selector on a trained DFlash drafter "
                                      "(the drafter frozen); writes the drafter with its selector"))
    f = tsub.add_parser("export-dflash", help="write a trained DFlash / DSpark drafter in the layout vLLM and SGLang "
                        "load (speculators: vLLM, DFlash and DSpark; dflash: z-lab's DFlashDraftModel)")
    f.add_argument("checkpoint", help="directory written by `verispec train dflash | dspark` (or a shipped name)")
    f.add_argument("out", help="directory for the export")
    f.add_argument("--format", default="speculators", choices=["speculators", "dflash"])
    f.add_argument("--model", default="smollm2-135m-instruct", help="the target the drafter was trained for")
    f.add_argument("--verifier", default=None, help="the target's name for the engine (default: --model)")
    f.add_argument("--mask-token-id", type=int, default=None, help="the id at mask positions (default: the "
                   "target's EOS; its row carries the learned mask vector)")
    f.add_argument("--dtype", default="bfloat16")
    c = tsub.add_parser("curve", help="fit a trained drafter's held-out learning curve, draw it and write what its "
                        "target would take (extrapolated) into its model card")
    c.add_argument("checkpoint", help="directory written by `verispec train eagle3 | dflash | dspark`")
    c.add_argument("--method", default=None, choices=["eagle3", "dflash", "dspark"], help="default: the log's")
    c.add_argument("--target", type=float, default=None, help="tau to reach (default: eagle3 2.5, dflash 3.0, "
                   "dspark 3.3)")
    c.add_argument("--offset", type=float, default=0.0, help="positions trained before this run (an --init "
                   "drafter's earlier training), added to the run's own")
    c.add_argument("--data-tokens", type=float, default=None, help="response tokens of the training data (default: "
                   "read from the data directory in the log)")
    c.add_argument("--note", default=None, help="a sentence added under the curve")
    v = tsub.add_parser("draft-vocab", help="store a DFlash / DSpark drafter's draft vocabulary: the most frequent "
                        "response tokens of training data, the only tokens it then proposes (inference only)")
    v.add_argument("checkpoint", help="directory written by `verispec train dflash | dspark`")
    v.add_argument("--data", nargs="+", required=True, help="data directories written by `verispec train data`")
    v.add_argument("--size", type=int, default=16384, help="tokens kept (default 16384)")
    x = tsub.add_parser("export-eagle3", help="write a trained EAGLE-3 head in the layout vLLM and SGLang load")
    x.add_argument("checkpoint", help="directory written by `verispec train eagle3` (or a shipped drafter's name)")
    x.add_argument("out", help="directory for the export")


def _target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the target (default: the model named in the data)")
    p.add_argument("--dtype", default="float32", help="the target's dtype during training")


def _data(args: argparse.Namespace) -> None:
    from verispec.train import data

    meta = data.run(args)
    print(json.dumps({k: meta[k] for k in ("num_sequences", "tokens", "response_tokens", "generate_s", "capture_s",
                                           "prompts_too_long")}, indent=1))


def _mix_data(args: argparse.Namespace) -> None:
    from verispec.train.mix import mix_sets

    meta = mix_sets(args.out, args.sets)
    print(f"{args.out}: {len(meta['shards'])} shards, {meta['num_sequences']} sequences, "
          f"{meta['response_tokens']} response tokens, layers {meta['layers']}")


def _merge_data(args: argparse.Namespace) -> None:
    from verispec.train.data import merge_parts

    meta = merge_parts(args.out, args.parts)
    print(f"{args.out}: {len(meta['shards'])} shards, {meta['num_sequences']} sequences, "
          f"{meta['response_tokens']} response tokens")


def _curve(args: argparse.Namespace) -> None:
    from verispec.train.card import add_curve_section

    method = args.method or json.loads((Path(args.checkpoint) / "train_log.json").read_text()).get("method")
    if method not in ("eagle3", "dflash", "dspark"):
        raise SystemExit(f"verispec: error: {args.checkpoint}: name the drafter's --method (the log says {method!r})")
    print(add_curve_section(args.checkpoint, method, target=args.target, offset=args.offset,
                            data_tokens=args.data_tokens, note=args.note))


def _draft_vocab(args: argparse.Namespace) -> None:
    from verispec.drafters import draft_vocab
    from verispec.train.share import response_counts

    cfg_path = Path(args.checkpoint) / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    if cfg.get("architectures") not in (["DFlashDraftModel"], ["DSparkDraftModel"]):
        raise SystemExit(f"verispec: error: {args.checkpoint} is not a DFlash / DSpark checkpoint")
    vocab = int(cfg["vocab_size"])
    if not 0 < args.size <= vocab:
        raise SystemExit(f"verispec: error: --size must be 1..{vocab}, got {args.size}")
    counts = sum(response_counts(d, vocab) for d in args.data)
    ids = draft_vocab.most_frequent(counts, args.size)
    path = draft_vocab.write(args.checkpoint, ids, vocab)
    total = int(counts.sum())
    print(f"wrote {path}: {args.size} of {vocab} tokens, {100 * int(counts[ids].sum()) / max(total, 1):.2f}% of "
          f"the {total} response tokens in {len(args.data)} data set(s)")


def _export_dflash(args: argparse.Namespace) -> None:
    from verispec.drafters.dflash import load
    from verispec.drafters.dflash_export import export
    from verispec.drafters.shipped import resolve
    from verispec.models.loader import load_model, parse_dtype

    target, _ = load_model(args.model, dtype="float32", device="cpu")
    drafter = load(resolve(args.checkpoint), target, inference=False)
    path = export(drafter, target, args.out, args.format, args.mask_token_id, args.verifier or args.model,
                  parse_dtype(args.dtype))
    print(f"wrote {path} ({args.format} layout)")


def _export_eagle3(args: argparse.Namespace) -> None:
    from verispec.drafters.eagle3_export import export_from_checkpoint

    print(f"wrote {export_from_checkpoint(args.checkpoint, args.out)}")


def _selector(args: argparse.Namespace) -> None:
    from verispec.train import selector

    log = selector.run(args)
    print(json.dumps({"selector_params": log["selector_params"], "train_anchors": log["train_anchors"],
                      "heldout_before": log["heldout"][0], "heldout_after": log["heldout"][-1]}, indent=1))


def _eagle3(args: argparse.Namespace) -> None:
    from verispec.train import eagle3

    if args.quick:  # tiny and short: proves data -> training -> checkpoint end to end
        args.updates = args.updates or 3
        args.intermediate_size = args.intermediate_size or 64
        args.draft_vocab = min(args.draft_vocab, 2048)
        args.ttt_steps = min(args.ttt_steps, 3)
        args.max_len = min(args.max_len, 256)
        args.batch = 1
    info = eagle3.run(args)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, one rank reports
        print(json.dumps({k: info[k] for k in ("updates", "wall_s", "heldout_before", "heldout_after")}, indent=1))


def _block_drafter(args: argparse.Namespace) -> None:
    from verispec.train import dflash

    info = dflash.run(args, args.train_command)
    if isinstance(info, dict) and os.environ.get("RANK", "0") == "0":
        print(json.dumps({k: v for k, v in info.items() if k != "curve"}, indent=1, default=str)[:4000])


COMMANDS = {"data": _data, "merge-data": _merge_data, "mix-data": _mix_data, "curve": _curve,
            "draft-vocab": _draft_vocab, "export-dflash": _export_dflash,
            "export-eagle3": _export_eagle3, "selector": _selector, "eagle3": _eagle3, "dflash": _block_drafter,
            "dspark": _block_drafter}


def cmd_train(args: argparse.Namespace) -> int:
    COMMANDS[args.train_command](args)
    return 0
