"""The wire layer: generated stubs (``_gen``) and conversion to TaskD's values.

Only this package, the controller's service module and the client import
protobuf types; everything else works with :mod:`taskd_core.models`.
"""

from __future__ import annotations

from taskd_core.rpc._gen import recover_pb2, recover_pb2_grpc

SERVICE_NAME = "Recover"
#: Trailing metadata of a standby replica's UNAVAILABLE answer: the leading replica's ``HOST:PORT``.
LEADER_METADATA = "taskd-leader"

__all__ = ["LEADER_METADATA", "SERVICE_NAME", "recover_pb2", "recover_pb2_grpc"]
