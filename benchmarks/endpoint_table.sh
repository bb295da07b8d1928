#!/usr/bin/env bash
# One `pagecli bench --endpoint` table with three rows on one workload: the in-process engine
# (`local`), `pagecli serve`, and llama.cpp's `llama-server` on the same GGUF file and thread
# count, --max-concurrency 16. Repeats the whole table REPS times (default 3); each run's JSON
# goes to $OUT (default /tmp/endpoint_table), and the last table is printed.
#
#   benchmarks/endpoint_table.sh [REPS]
#
# Quiet machines only. The llama.cpp binaries are in ../shared/peers/llama.cpp/bin.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}
THREADS=${THREADS:-2}
OUT=${OUT:-/tmp/endpoint_table}
PEERS=${PAGECLI_PEERS:-../shared/peers}/llama.cpp/bin
mkdir -p "$OUT"
GGUF=$(.venv/bin/python -c "from pagecli.loader.resolve import default_gguf_path; print(default_gguf_path())")
SERVE_PORT=8411
LLAMA_PORT=8412

.venv/bin/pagecli serve --port $SERVE_PORT --num-threads "$THREADS" >/dev/null 2>"$OUT/serve.err" &
SERVE_PID=$!
"$PEERS/llama-server" -m "$GGUF" -t "$THREADS" --host 127.0.0.1 --port $LLAMA_PORT -c 8192 -np 16 \
    >"$OUT/llama-server.err" 2>&1 &
LLAMA_PID=$!
trap 'kill $SERVE_PID $LLAMA_PID 2>/dev/null || true' EXIT
for port in $SERVE_PORT $LLAMA_PORT; do
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        sleep 0.2
    done
done

ARGS=(--endpoint pagecli=local --endpoint "serve=http://127.0.0.1:$SERVE_PORT/v1"
      --endpoint "llama-server=http://127.0.0.1:$LLAMA_PORT/v1"
      --max-concurrency 16 --num-prompts 32 --input-len 32:256 --output-len 16:128
      --num-threads "$THREADS")
for rep in $(seq "$REPS"); do
    .venv/bin/pagecli bench "${ARGS[@]}" --json >"$OUT/rep$rep.json" 2>>"$OUT/bench.err"
done
.venv/bin/python - "$OUT" "$REPS" <<'EOF'
import json, statistics, sys
from pagecli.cli.bench_report import print_report

out, reps = sys.argv[1], int(sys.argv[2])
runs = [json.load(open(f"{out}/rep{i}.json")) for i in range(1, reps + 1)]
print_report(runs[-1], False, False)
names = [row["engine"] for row in runs[0]["results"]]
for key in ("output_tokens_per_s", "total_tokens_per_s"):
    for name in names:
        values = [r["output_tokens_per_s" if key == "output_tokens_per_s" else key]
                  for run in runs for r in run["results"] if r["engine"] == name]
        print(f"{name}: {key} median {statistics.median(values):.1f} over {reps} ({', '.join(f'{v:.1f}' for v in values)})")
for name in names[1:]:
    ratios = [
        next(r for r in run["results"] if r["engine"] == names[0])["output_tokens_per_s"]
        / next(r for r in run["results"] if r["engine"] == name)["output_tokens_per_s"]
        for run in runs
    ]
    print(f"{names[0]}/{name} output tok/s: median {statistics.median(ratios):.2f}x")
EOF
