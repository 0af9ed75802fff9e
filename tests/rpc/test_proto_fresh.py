"""The committed stubs are exactly what scripts/gen_proto.py generates from proto/."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "taskd_core" / "rpc" / "_gen"


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    """Regenerating into a temporary tree reproduces every committed file byte for byte."""
    argv = sys.argv
    sys.argv = ["gen_proto.py", str(tmp_path)]
    try:
        runpy.run_path(str(ROOT / "scripts" / "gen_proto.py"), run_name="__main__")
    finally:
        sys.argv = argv
    fresh = tmp_path / "taskd_core" / "rpc" / "_gen"
    names = sorted(p.name for p in fresh.iterdir() if p.suffix in {".py", ".pyi"})
    assert names == ["etcd_v3_pb2.py", "etcd_v3_pb2.pyi", "recover_pb2.py", "recover_pb2.pyi", "recover_pb2_grpc.py"]
    stale = [n for n in names if (fresh / n).read_bytes() != (GEN / n).read_bytes()]
    assert not stale, f"stale generated files {stale}: run `python scripts/gen_proto.py` and commit"


def test_service_has_no_proto_package() -> None:
    """ClusterD compatibility: method paths are /Recover/<Method>."""
    from taskd_core.rpc import recover_pb2

    service = recover_pb2.DESCRIPTOR.services_by_name["Recover"]
    assert service.full_name == "Recover"
    assert {m.name for m in service.methods} >= {
        "Init", "Register", "SubscribeProcessManageSignal", "ReportStopComplete",
        "ReportRecoverStrategy", "ReportRecoverStatus", "ReportProcessFault", "HealthCheck",
    }


def test_reference_field_numbers_are_kept() -> None:
    """Every reference field keeps its name and number; extensions are numbered 100 and up."""
    from taskd_core.rpc import recover_pb2 as pb

    reference = {
        "Status": {"code": 1, "info": 2},
        "ClientInfo": {"jobId": 1, "role": 2},
        "FaultRank": {"rankId": 1, "faultType": 2},
        "ProcessManageSignal": {
            "uuid": 1, "jobId": 2, "signalType": 3, "actions": 4, "faultRanks": 5,
            "changeStrategy": 6, "timeout": 7, "nodeRankIds": 8, "extraParams": 9,
        },
        "StopCompleteRequest": {"jobId": 1, "status": 2, "faultRanks": 3},
        "RecoverStrategyRequest": {"jobId": 1, "faultRanks": 2, "strategies": 3},
        "RecoverStatusRequest": {"jobId": 1, "status": 2, "strategy": 3, "isolateRankIds": 4},
        "ProcessFaultRequest": {"jobId": 1, "faultRanks": 2},
    }
    for message, fields in reference.items():
        descriptor = getattr(pb, message).DESCRIPTOR
        assert descriptor.full_name == message
        numbers = {f.name: f.number for f in descriptor.fields}
        for name, number in fields.items():
            assert numbers[name] == number, f"{message}.{name}"
        extra = set(numbers) - set(fields)
        assert all(numbers[n] >= 100 for n in extra), f"{message} extensions {extra} must be numbered 100+"
