#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv at .venv and install everything the
# main job and the test suite need: taskd-core, both adapters, torch 2.13 CPU,
# MindSpore 2.10 CPU and the test tools. Safe to run again; it only adds.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
py=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
stamp="$venv/.taskd-installed"
want=$(cat "$root/pyproject.toml" "$root"/plugins/*/pyproject.toml "$root/scripts/env.sh" 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    # torch first, pinned: an unpinned request would fetch a multi-GB CUDA build.
    "${pip[@]}" "torch==2.13.0"
    "${pip[@]}" "mindspore==2.10.0"
    # compat mode puts the source folders on sys.path, which keeps the shared
    # PEP 420 namespace "taskd" importable from both distributions.
    "${pip[@]}" --config-settings editable_mode=compat -e "$root[test]"
    for plugin in "$root"/plugins/*/; do
        [ -f "$plugin/pyproject.toml" ] && "${pip[@]}" --config-settings editable_mode=compat -e "$plugin"
    done
    echo "$want" > "$stamp"
fi
