"""Compatibility path of the seed document's ``pb``: the generated messages."""

from taskd_core.rpc._gen.recover_pb2 import *  # noqa: F403
from taskd_core.rpc._gen.recover_pb2 import DESCRIPTOR  # noqa: F401
