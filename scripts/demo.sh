#!/usr/bin/env bash
# Run the main job: DDP training under `taskd run` on the embedded controller,
# one rank killed mid-training, recovered. Installs what it needs first.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/env.sh"
exec "$root/.venv/bin/python" "$root/examples/demo.py" "$@"
