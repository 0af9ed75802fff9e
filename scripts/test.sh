#!/usr/bin/env bash
# Run the whole test suite (fast tier and the slow real-framework tests) and the code checks
# (scripts/checks.sh: ruff and mypy --strict); fails when either fails.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/env.sh"
cd "$root"
checks=0
bash "$root/scripts/checks.sh" || checks=$?
"$root/.venv/bin/python" -m pytest "$@"
exit "$checks"
