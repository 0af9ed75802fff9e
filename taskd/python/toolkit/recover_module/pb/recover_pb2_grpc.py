"""Compatibility path of the seed document's ``pb``: the generated service stubs."""

from taskd_core.rpc._gen.recover_pb2_grpc import *  # noqa: F403
