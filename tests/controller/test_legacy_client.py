"""A legacy client (the reference's old schema, role "master agent", no extensions) recovers a job.

The old schema lacks ProcessManageSignal fields 8/9 and RecoverStatusRequest
field 4, like the real Python client's ``recover_pb2.py``. It is generated
into tmp_path and used from a child interpreter, because its messages carry
the same package-less names as ours and cannot share one descriptor pool.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from grpc_tools import protoc

LEGACY_PROTO = """
syntax = "proto3";
service Recover {
  rpc Init(ClientInfo) returns (Status) {}
  rpc Register(ClientInfo) returns (Status) {}
  rpc SubscribeProcessManageSignal(ClientInfo) returns (stream ProcessManageSignal) {}
  rpc ReportStopComplete(StopCompleteRequest) returns (Status) {}
  rpc ReportRecoverStrategy(RecoverStrategyRequest) returns (Status) {}
  rpc ReportRecoverStatus(RecoverStatusRequest) returns (Status) {}
  rpc ReportProcessFault(ProcessFaultRequest) returns (Status) {}
  rpc HealthCheck(ClientInfo) returns (Status) {}
}
message Status { int32 code = 1; string info = 2; }
message ClientInfo { string jobId = 1; string role = 2; }
message FaultRank { string rankId = 1; string faultType = 2; }
message ProcessManageSignal {
  string uuid = 1; string jobId = 2; string signalType = 3; repeated string actions = 4;
  repeated FaultRank faultRanks = 5; string changeStrategy = 6; int64 timeout = 7;
}
message StopCompleteRequest { string jobId = 1; Status status = 2; repeated FaultRank faultRanks = 3; }
message RecoverStrategyRequest {
  string jobId = 1; repeated FaultRank faultRanks = 2; repeated string strategies = 3;
}
message RecoverStatusRequest { string jobId = 1; Status status = 2; string strategy = 3; }
message ProcessFaultRequest { string jobId = 1; repeated FaultRank faultRanks = 2; }
"""

# Acts like the reference's DLRecoverManager: Init -> Register -> Subscribe, answer each signal.
LEGACY_CLIENT = """
import json, sys
import grpc
import legacy_recover_pb2 as pb, legacy_recover_pb2_grpc as rpc

address, job = sys.argv[1], sys.argv[2]
info = pb.ClientInfo(jobId=job, role="master agent")
with grpc.insecure_channel(address) as channel:
    stub = rpc.RecoverStub(channel)
    codes = [stub.Init(info).code, stub.Register(info).code]
    stream = stub.SubscribeProcessManageSignal(info)
    faults = [pb.FaultRank(rankId="3", faultType="1")]
    codes.append(stub.ReportProcessFault(pb.ProcessFaultRequest(jobId=job, faultRanks=faults)).code)
    seen = []
    for sig in stream:
        if sig.signalType == "keep-alive":
            continue
        seen.append([sig.signalType, list(sig.actions), sig.changeStrategy])
        if "stop_train" in sig.actions:
            codes.append(stub.ReportStopComplete(pb.StopCompleteRequest(jobId=job, status=pb.Status())).code)
        elif "on_global_rank" in sig.actions:
            req = pb.RecoverStrategyRequest(jobId=job, strategies=["recover", "dump", "exit"])
            codes.append(stub.ReportRecoverStrategy(req).code)
        elif "change_strategy" in sig.actions:
            req = pb.RecoverStatusRequest(jobId=job, status=pb.Status(code=0), strategy=sig.changeStrategy)
            codes.append(stub.ReportRecoverStatus(req).code)
            break
    stream.cancel()
print(json.dumps({"codes": codes, "seen": seen}))
"""


def test_a_legacy_client_completes_a_recover_cycle(controller, make_agent, tmp_path):
    (tmp_path / "legacy_recover.proto").write_text(LEGACY_PROTO)
    assert (
        protoc.main(
            [
                "protoc",
                f"-I{tmp_path}",
                f"--python_out={tmp_path}",
                f"--grpc_python_out={tmp_path}",
                str(tmp_path / "legacy_recover.proto"),
            ]
        )
        == 0
    )
    (tmp_path / "client.py").write_text(textwrap.dedent(LEGACY_CLIENT))
    done = subprocess.run(
        [sys.executable, str(tmp_path / "client.py"), controller.address, "legacy-job"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["codes"] == [0] * 6
    assert result["seen"] == [
        ["stopTrain", ["stop_train"], ""],
        ["globalFault", ["on_global_rank"], ""],
        ["changeStrategy", ["change_strategy"], "recover"],
    ]
    view = make_agent(controller.address, "legacy-job").job(events=50)
    assert view.state == "idle" and view.agents[0].agentId == "master agent"
    assert "cycle succeeded" in [e.kind for e in view.events]
