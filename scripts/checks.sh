#!/usr/bin/env bash
# Lint (ruff: pycodestyle at the configured line length, pyflakes, imports, bugbear, pyupgrade) of
# every Python file, and strict typing (mypy --strict, configured in pyproject.toml) of everything
# TaskD ships: taskd_core, the seed paths under taskd/, and both adapters' sources. Fails on either.
# scripts/test.sh (and so CI's .ci/run) runs it beside the test suite.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
paths=(taskd_core taskd plugins/mindspore/src plugins/pytorch/src)
failed=0
# ruff also reads the tests, benchmarks, examples and scripts (pyproject.toml: what they may skip).
echo "== ruff check ."
"$root/.venv/bin/ruff" check . || failed=1
echo "== mypy --strict ${paths[*]}"
"$root/.venv/bin/mypy" --strict "${paths[@]}" || failed=1
if [ "$failed" -ne 0 ]; then
    echo "checks failed: fix the findings above (ruff check --fix repairs some)" >&2
fi
exit "$failed"
