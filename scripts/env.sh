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
# This machine's pip config lists local package folders that may not exist;
# pip warns about each of them on every call, which buries real errors.
quiet() { "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2); }
stamp="$venv/.taskd-installed"
want=$(cat "$root/pyproject.toml" "$root"/plugins/*/pyproject.toml "$root/scripts/env.sh" 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    # torch first, pinned: an unpinned request would fetch a multi-GB CUDA build.
    quiet "${pip[@]}" "torch==2.13.0"
    quiet "${pip[@]}" "mindspore==2.10.0"
    # compat mode puts the source folders on sys.path, which keeps the shared
    # PEP 420 namespace "taskd" importable from both distributions.
    quiet "${pip[@]}" --config-settings editable_mode=compat -e "$root[test,timeline]"
    for plugin in "$root"/plugins/*/; do
        if [ -f "$plugin/pyproject.toml" ]; then
            quiet "${pip[@]}" --config-settings editable_mode=compat -e "$plugin"
        fi
    done
    echo "$want" > "$stamp"
fi
