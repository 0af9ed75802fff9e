"""Regenerate the committed stubs from ``proto/``: ``recover.proto`` and ``etcd_v3.proto``.

Usage: ``python scripts/gen_proto.py [OUT_ROOT]``. OUT_ROOT defaults to the
repository root; the test suite passes a temporary directory and compares.
The ``-I<virtual path>=proto`` form makes protoc emit absolute imports
(``from taskd_core.rpc._gen import recover_pb2``) with no rewriting step.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
GEN_PACKAGE = "taskd_core/rpc/_gen"


def generate(out_root: Path) -> None:
    (out_root / GEN_PACKAGE).mkdir(parents=True, exist_ok=True)
    include = [f"-I{GEN_PACKAGE}={ROOT / 'proto'}", f"-I{Path(protoc.__file__).parent / '_proto'}"]
    messages = [f"--python_out={out_root}", f"--pyi_out={out_root}"]
    # etcd_v3.proto declares messages only (its services are named by path in etcd_client.py).
    for args in (
        [*messages, f"--grpc_python_out={out_root}", f"{GEN_PACKAGE}/recover.proto"],
        [*messages, f"{GEN_PACKAGE}/etcd_v3.proto"],
    ):
        argv = ["protoc", *include, *args]
        if protoc.main(argv) != 0:
            raise SystemExit(f"protoc failed: {' '.join(argv)}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
