#!/usr/bin/env bash
# Every GPU check in one run (benchmarks/gpu_check.py; docs/engine.md, "GPU check"), from the source tree:
# no install step, the machine's own torch and transformers. The JSON report is rewritten after every
# section, so a timeout keeps what finished.
#
#   bash benchmarks/gpu_check.sh                      # H100/H200: < 5 min; report in ./gpu_check_out/gpu_check.json
#   OUT=/tmp/r bash benchmarks/gpu_check.sh --tiny --device cpu   # every section, tiny shapes, CPU
#
# Environment: OUT (report folder, default ./gpu_check_out), PYTHON (interpreter, default python3, else
# python), GPU_CHECK_HARD_TIMEOUT (seconds before an external SIGTERM, default 300; 0: none).
# Arguments go to the Python driver (--help lists them).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
export OUT="${OUT:-./gpu_check_out}"
mkdir -p "${OUT}"
PY="${PYTHON:-}"
if [[ -z "${PY}" ]]; then
  PY="$(command -v python3 || command -v python)"
fi
HARD="${GPU_CHECK_HARD_TIMEOUT:-300}"
if [[ "${HARD}" != "0" ]] && command -v timeout >/dev/null 2>&1; then
  # SIGTERM at HARD seconds: the driver records the running section as killed; SIGKILL 15 s later
  exec timeout --signal=TERM --kill-after=15 "${HARD}" "${PY}" "${ROOT}/benchmarks/gpu_check.py" "$@"
fi
exec "${PY}" "${ROOT}/benchmarks/gpu_check.py" "$@"
