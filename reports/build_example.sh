#!/usr/bin/env bash
# Rebuild reports/example from the default search's results; runs the default search first when
# its results are missing. Usage: reports/build_example.sh [RESULTS]  (default: results/default)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RESULTS=${1:-results/default}
if [ ! -d "$RESULTS/trials" ]; then
  "$PY" -m dptune.search --space search_spaces/default.yaml --storage "$(dirname "$RESULTS")" \
    --name "$(basename "$RESULTS")" --no-report
fi
"$PY" -m dptune.report "$RESULTS" --out reports/example --title "dptune example report: the default search"
