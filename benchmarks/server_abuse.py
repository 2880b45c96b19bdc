"""What one abusive client costs everyone else: `verispec serve` (the default model, 127.0.0.1) with guard streams
running while each request of issue 67 is sent, against the same guards with nothing else running.

Conditions: concurrency = `--guards` greedy streams (`ignore_eos`, `return_token_ids`) decoding in a loop for the
whole phase, plus /health polled every 0.1 s on a fresh connection; metric = the guards' output tokens per second
over the phase, /health latency (p95, max) and the server log's growth; baseline = the same guards in a phase with
no abuse, phases interleaved (none, abuse, none, abuse, ...) and repeated; the slowdown is the median over repeats
of baseline tok/s / abused tok/s (each abused phase against the baseline phase before it). The abuse:

  stop_ids  two at once: /v1/completions, n=16, 200 tokens, stop_token_ids = [1] * 2,000,000 (a 4.0 MB body)
  stop_ids_1mb  the same with 400,000 ids (0.8 MB, under the default body limit: read, parsed, then refused)
  prompt    eight at once: /v1/completions with a 1.3 MB text prompt (the context holds 2,048 tokens)
  prompt_0_9mb  the same with 0.9 MB of text (read, parsed, its tokens counted in pieces, then refused)
  idle      2,000 connections opened and never written to
  slowbody  50 connections that send their headers (Content-Length 1,000) and then one body byte a second

Loopback only, every loop bounded; the server is started and stopped here (SIGTERM, with one request half-sent:
the `sigterm` row). Run it niced:

    nice -n 10 python benchmarks/server_abuse.py --phase-seconds 12 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

GUARD = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True,
         "return_token_ids": True}


def start_server(log: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """`verispec serve` on a free loopback port, its output in `log`; returns it and its base URL."""
    cmd = [sys.executable, "-m", "verispec", "serve", "--host", "127.0.0.1", "--port", "0", *extra]
    out = log.open("wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text(errors="replace"))
        if m:
            return proc, m.group(1)
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not start; see {log}")


def guard_loop(url: str, stop: threading.Event, counts: list[int]) -> None:
    """Stream guard requests one after another until `stop`; adds each token received to counts[0]."""
    with httpx.Client(timeout=120) as c:
        while not stop.is_set():
            with c.stream("POST", f"{url}/v1/completions", json=GUARD) as r:
                for line in r.iter_lines():
                    if stop.is_set():
                        break
                    if line.startswith("data: {"):
                        counts[0] += len(json.loads(line[6:])["choices"][0].get("token_ids") or ())


MARKS: dict[str, float] = {}  # "opened": when the idle abuse had all its connections open (perf_counter)


def health_loop(url: str, stop: threading.Event, lat: list[tuple[float, float]]) -> None:
    """GET /health every 0.1 s on a fresh connection: (start, latency in seconds; a failure counts as 10 s)."""
    while not stop.is_set():
        t = time.perf_counter()
        try:
            ok = httpx.get(f"{url}/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            ok = False
        lat.append((t, time.perf_counter() - t if ok else 10.0))
        stop.wait(0.1)


def post_status(url: str, body: bytes, out: list, timeout: float = 300) -> None:
    t = time.perf_counter()
    try:
        r = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=timeout)
        out.append((r.status_code, time.perf_counter() - t))
    except httpx.HTTPError as e:
        out.append((type(e).__name__, time.perf_counter() - t))


def abuse_stop_ids(url: str, stop: threading.Event, out: list) -> None:
    body = json.dumps({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 200, "temperature": 0, "n": 16, "seed": 1,
                       "stop_token_ids": [1] * 2_000_000}, separators=(",", ":")).encode()
    threads = [threading.Thread(target=post_status, args=(url, body, out)) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]


def abuse_stop_ids_1mb(url: str, stop: threading.Event, out: list) -> None:
    """As stop_ids, with 400,000 ids (0.8 MB): under the default body limit, so the body is read and parsed."""
    body = json.dumps({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 200, "temperature": 0, "n": 16, "seed": 1,
                       "stop_token_ids": [1] * 400_000}, separators=(",", ":")).encode()
    threads = [threading.Thread(target=post_status, args=(url, body, out)) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]


def abuse_prompt(url: str, stop: threading.Event, out: list, size: int = 1_300_000) -> None:
    words = ("the quick brown fox jumps over the lazy dog and keeps running " * 20_000)[:size]
    body = json.dumps({"prompt": words, "max_tokens": 16}).encode()
    threads = [threading.Thread(target=post_status, args=(url, body, out)) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]


def abuse_prompt_0_9mb(url: str, stop: threading.Event, out: list) -> None:
    """As prompt, 0.9 MB: under the default body limit, so it is read, parsed and its tokens counted."""
    abuse_prompt(url, stop, out, 900_000)


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def abuse_idle(url: str, stop: threading.Event, out: list, n: int = 2000) -> None:
    """n connections, never written to, held until `stop`; records how many the server had closed by then."""
    socks = []
    for _ in range(n):
        try:
            socks.append(socket.create_connection(_host_port(url), timeout=5))
        except OSError as e:
            out.append((f"connect failed: {e.errno}", 0.0))
            break
    t = MARKS["opened"] = time.perf_counter()
    stop.wait()
    closed = 0
    for s in socks:
        s.setblocking(False)
        try:
            s.recv(4096)  # data (the 408) or EOF: the server gave up on it
            closed += 1
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        s.close()
    out.append((f"{len(socks)} opened, {closed} closed by the server", time.perf_counter() - t))


def abuse_slow_body(url: str, stop: threading.Event, out: list, n: int = 50) -> None:
    """n requests whose body trickles in a byte a second; records the status each gets (or what happened)."""
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n")
    socks = [socket.create_connection(_host_port(url), timeout=5) for _ in range(n)]
    for s in socks:
        s.sendall(head)
        s.setblocking(False)
    t0, answers = time.perf_counter(), {}
    while not stop.is_set() and len(answers) < n and time.perf_counter() - t0 < 120:
        for i, s in enumerate(socks):
            if i in answers:
                continue
            try:
                s.send(b" ")
                data = s.recv(4096)
                answers[i] = data.split(b" ")[1].decode() if data else "closed"
            except BlockingIOError:
                pass
            except OSError:
                answers[i] = "reset"
        stop.wait(1.0)
    for i, s in enumerate(socks):
        out.append((answers.get(i, "still open"), time.perf_counter() - t0))
        s.close()


ABUSE = {"stop_ids": abuse_stop_ids, "stop_ids_1mb": abuse_stop_ids_1mb, "prompt": abuse_prompt, "prompt_0_9mb": abuse_prompt_0_9mb, "idle": abuse_idle, "slowbody": abuse_slow_body}


def phase(url: str, log: Path, seconds: float, guards: int, abuse: str | None) -> dict:
    """Guards (and the abuse, if any) for `seconds` or until the abuse has ended, whichever is later."""
    stop, abuse_done = threading.Event(), threading.Event()
    counts = [[0] for _ in range(guards)]
    samples: list[tuple[float, float]] = []
    MARKS.pop("opened", None)
    statuses: list = []
    size0 = log.stat().st_size
    workers = [threading.Thread(target=guard_loop, args=(url, stop, c)) for c in counts]
    workers.append(threading.Thread(target=health_loop, args=(url, stop, samples)))
    [w.start() for w in workers]
    time.sleep(1.0)  # the guards are decoding before the abuse starts
    t0, base = time.perf_counter(), sum(c[0] for c in counts)
    if abuse is not None:
        def run() -> None:
            ABUSE[abuse](url, abuse_done, statuses)
        a = threading.Thread(target=run)
        a.start()
        if abuse == "idle":  # held for the phase, then released
            time.sleep(seconds)
            abuse_done.set()
        a.join(600)
    left = seconds - (time.perf_counter() - t0)
    if left > 0:
        time.sleep(left)
    elapsed, tokens = time.perf_counter() - t0, sum(c[0] for c in counts) - base
    stop.set()
    [w.join(180) for w in workers]
    lat = sorted(x for _, x in samples)
    # the idle abuse: /health while the connections are held, apart from the burst that opened them
    held = [x for t, x in samples if "opened" in MARKS and t >= MARKS["opened"]]
    return {"abuse": abuse, "tok_s": tokens / elapsed, "seconds": elapsed, "load": os.getloadavg()[0],
            "health_p95": lat[int(0.95 * (len(lat) - 1))] if lat else None, "health_max": lat[-1] if lat else None,
            "health_max_held": max(held) if held else None,
            "log_bytes": log.stat().st_size - size0, "statuses": statuses}


def sigterm_half_body(proc: subprocess.Popen, url: str) -> dict:
    """SIGTERM while a request's body is half sent: what that request gets and how long the exit takes."""
    s = socket.create_connection(_host_port(url), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: 100\r\n\r\n{\"prompt\": ")
    time.sleep(0.5)
    t = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        data = s.recv(4096)
    except OSError as e:
        data = repr(e).encode()
    proc.wait(120)
    exit_s = time.perf_counter() - t
    first = data.split(b"\r\n", 1)[0].decode(errors="replace")
    ctype = re.search(rb"content-type: ([^\r]+)", data, re.I)
    return {"answer": first, "content_type": ctype.group(1).decode() if ctype else None, "exit_s": exit_s}


def summarize(rows: list[dict], log: Path, sig: dict) -> str:
    out = ["| abuse | statuses (seconds to answer) | guard slowdown (median, range) | /health p95 / max (s) | "
           "log growth (bytes) |", "|---|---|---|---|---|"]
    for name in ABUSE:
        pairs = [(rows[i - 1], r) for i, r in enumerate(rows) if r["abuse"] == name and i > 0]
        if not pairs:
            continue
        ratios = [b["tok_s"] / r["tok_s"] if r["tok_s"] else float("inf") for b, r in pairs]
        sts: dict = {}
        for _, r in pairs:
            for st, sec in r["statuses"]:
                sts.setdefault(st, []).append(sec)
        shown = "; ".join(f"{k} x{len(v)} ({min(v):.2f}-{max(v):.2f})" for k, v in sts.items())
        p95 = max(r["health_p95"] or 0 for _, r in pairs)
        mx = max(r["health_max"] or 0 for _, r in pairs)
        held = [r["health_max_held"] for _, r in pairs if r.get("health_max_held") is not None]
        shown_max = f"{mx:.3f}" + (f" (while held: {max(held):.3f})" if held else "")
        out.append(f"| {name} | {shown} | x{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | "
                   f"{p95:.3f} / {shown_max} | {max(r['log_bytes'] for _, r in pairs)} |")
    base = [r for r in rows if r["abuse"] is None]
    out.append(f"| none (baseline) | - | guards {statistics.median(r['tok_s'] for r in base):.1f} tok/s | "
               f"{max(r['health_p95'] for r in base):.3f} / {max(r['health_max'] for r in base):.3f} | "
               f"{max(r['log_bytes'] for r in base)} |")
    loads = [r["load"] for r in rows]
    out.append(f"\nMachine load average (1 min) over the phases: {min(loads):.1f}-{max(loads):.1f}.")
    out.append(f"\nSIGTERM with a body half sent: answered `{sig['answer']}` ({sig['content_type']}), server exited "
               f"{sig['exit_s']:.2f} s after the signal. Whole log: {log.stat().st_size} bytes; tracebacks in it: "
               f"{log.read_text(errors='replace').count('Traceback')}.")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase-seconds", type=float, default=12.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--guards", type=int, default=2)
    ap.add_argument("--only", default=",".join(ABUSE), help="comma-separated abuse names")
    ap.add_argument("--serve-args", default="", help="extra `verispec serve` arguments")
    args = ap.parse_args()
    log = Path(tempfile.mkdtemp(prefix="server_abuse_")) / "serve.log"
    proc, url = start_server(log, args.serve_args.split())
    rows: list[dict] = []
    try:
        phase(url, log, 4, args.guards, None)  # warm-up
        for rep in range(args.repeats):
            for name in args.only.split(","):
                for abuse in (None, name):
                    rows.append(phase(url, log, args.phase_seconds, args.guards, abuse))
                    r = rows[-1]
                    print(f"rep {rep} {abuse or 'none':9s} {r['tok_s']:6.1f} tok/s  load {r['load']:.1f}  "
                          f"health p95 {r['health_p95']:.3f}"
                          f"  log +{r['log_bytes']}  {r['statuses'][:3]}", flush=True)
        sig = sigterm_half_body(proc, url)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    print(summarize(rows, log, sig))
    print(f"log: {log}")


if __name__ == "__main__":
    main()
