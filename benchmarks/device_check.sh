#!/usr/bin/env bash
# One run on a machine with a CUDA GPU, first thing whenever one is lent: the gpu test tier, the
# device-aware benchmarks (decode with and without CUDA graphs too) and serving on the GPU, all
# figures into one file. About 10 minutes (11 if every step ran to its limit, as before);
# every step has its own time limit so a hang in one still leaves the others' figures.
#
#   bash benchmarks/device_check.sh                 # writes $OUT/device_check.md (default: benchmarks/results)
#
# Exit status: 0 when the gpu tier passed, 1 otherwise (the benchmarks' failures are in the file).
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-benchmarks/results}"
mkdir -p "$out_dir"
report="$out_dir/device_check.md"
gpus=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
{
  echo "# device check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi: not found"
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())"
  echo '```'
} >"$report"
if [ "$gpus" -eq 0 ]; then
  echo "torch sees no CUDA device: nothing to check here (a CUDA build of torch and a GPU are needed)" | tee -a "$report"
  exit 1
fi

section() {  # section TITLE LIMIT_S COMMAND...: run it with a limit, its output's tail into the report
  local title=$1 limit=$2
  shift 2
  local log
  log=$(mktemp)
  echo "== $title"
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  { echo; echo "## $title (exit $rc)"; echo; echo '```'; tail -n 60 "$log"; echo '```'; } >>"$report"
  return $rc
}

section "gpu tier: python -m pytest -q -m gpu" 270 python -m pytest -q -m gpu -p no:cacheprovider -rs
tier=$?
section "decode step on cuda (benchmarks/run.py --device cuda --quick)" 120 \
  python benchmarks/run.py --device cuda --quick
# decode buckets captured as CUDA graphs vs the same compiled buckets uncaptured (cudagraph_mode NONE)
section "decode step with and without CUDA graphs (benchmarks/device_graphs.py --quick, inductor)" 120 \
  python benchmarks/device_graphs.py --quick --batches 1 4
tp=$(( gpus >= 2 ? 2 : 1 ))
section "serving on cuda (benchmarks/serve_throughput.py --quick -tp $tp -dcp $tp --device cuda)" 150 \
  python benchmarks/serve_throughput.py --quick -tp "$tp" -dcp "$tp" --device cuda
echo "figures: $report"
exit $(( tier == 0 ? 0 : 1 ))
