#!/usr/bin/env bash
# One prepared check for a machine with one NVIDIA GPU (the H200 lent through the device tool).
# Under 8 minutes: kernel and engine tests on CUDA (Triton compiled, not interpreted), decode
# attention bandwidth against a device-to-device copy, and the engine beside transformers on a
# dummy-weights preset in bfloat16. Everything goes to one results file.
#
#   scripts/gpu_check.sh [RESULTS_FILE]     (default: $OUT/gpu_results.md, else ./gpu_results.md)
#
# The GPU machine has torch, triton, transformers, typer, rich, safetensors and huggingface-hub
# but not pytest or hypothesis: fetch their wheels once with scripts/fetch_gpu_wheels.sh into
# .whl/ (git-ignored) and carry `.whl` with the run.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${1:-${OUT:-.}/gpu_results.md}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export PAGECLI_CACHE_DIR="${TMPDIR:-/tmp}/pagecli-cache"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi

{
  echo "# pagecli GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  echo '```'
} > "$RESULTS"

section() { printf '\n## %s\n\n```\n' "$1" >> "$RESULTS"; }
end_section() { printf '```\n' >> "$RESULTS"; }

section "Kernel tests on CUDA (compiled Triton against the reference)"
PAGECLI_FULL_TESTS=1 PAGECLI_KERNEL_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_ops_triton.py tests/kernels/test_gated_delta_triton.py \
  tests/kernels/test_fused_moe_triton.py 2>&1 \
  | tail -15 >> "$RESULTS"
end_section

section "Config: attention_impl is validated (the engine's Triton interpreter test runs on CPUs)"
timeout 60 python3 -c "
from pagecli.config import EngineConfig
for impl in ('auto', 'triton', 'cpu', 'reference'):
    EngineConfig(attention_impl=impl)
print('attention_impl: auto, triton, cpu, reference accepted')
" >> "$RESULTS" 2>&1
end_section

section "Engine parity on CUDA (float32, tiny models, CUDA graphs on and off, attention_impl auto/triton/cpu) and bandwidth"
timeout 200 python3 scripts/gpu_engine_check.py >> "$RESULTS" 2>&1
end_section

section "Engine beside transformers (dummy weights, bfloat16)"
timeout 200 python3 scripts/gpu_bench.py >> "$RESULTS" 2>&1
end_section

cat "$RESULTS"
