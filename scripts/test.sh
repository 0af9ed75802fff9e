#!/usr/bin/env bash
# Run the whole test suite (fast tier and the slow real-framework tests).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
