"""Who a launch is and what it shows the controller: the launch identity, the default job id, credentials.

Every launcher derives them the same way, so the nodes of one launch agree
without talking (:func:`launch_identity`), a job that names no id still gets
one unique to its launch (:func:`default_job_id`), and the agent presents the
TLS files and the job token the environment gives (:func:`job_credentials`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import secrets
from collections.abc import Mapping

from taskd_core.errors import ConfigError
from taskd_core.models import Credentials
from taskd_core.values import check_secret, is_loopback, parse_address

logger = logging.getLogger(__name__)


def launch_identity(nnodes: int, shared: str, token: str = "") -> str:
    """The identity of one launch of a job, the same on all its nodes.

    One node: random, so every launch differs. Several nodes: derived from
    ``shared``, what every node of the launch is given alike (the master
    address and port, torchrun's rendezvous, msrun's scheduler), so the nodes
    agree without talking; two live launches cannot share those (their
    rendezvous would collide). It is keyed with the job token: whoever lacks
    the token cannot compute the identity (nor the default job id made from
    it) and claim it first. Only a tokenless job on loopback (a legacy job,
    which anyone may act on anyway) gets a plain digest.
    """
    if nnodes == 1:
        return secrets.token_hex(8)
    if token:
        return hmac.new(token.encode(), b"taskd-launch\0" + shared.encode(), hashlib.sha256).hexdigest()[:16]
    return hashlib.sha256(shared.encode()).hexdigest()[:16]


def default_job_id(launcher: str, launch: str) -> str:
    """The job id of a launch that names none: unique per launch (see :func:`launch_identity`)."""
    return f"{launcher}-{launch[:12]}"


def controller_host(controller: str) -> str:
    """The host the job-token rule judges (:func:`job_credentials`): any replica beyond loopback counts."""
    hosts = [parse_address(part).host for part in controller.split(",")]
    return next((host for host in hosts if not is_loopback(host)), hosts[0])


def job_credentials(
    env: Mapping[str, str], *, tls_ca: str | None, nnodes: int, controller_host: str, shared: str
) -> Credentials:
    """What this node's agent shows the controller: TLS files, the job token and the launch identity.

    The launch identity is :func:`launch_identity` of ``shared`` under the token.

    The token is ``TASKD_JOB_TOKEN``; a one-node launch without one generates
    its own (nobody else needs to know it). Several nodes must share one: a
    launch without it is refused unless its controller is on loopback, where
    the agents register as a legacy job. A token gRPC could not send (not
    printable ASCII) is refused here, before any connection is tried.
    """
    credentials = Credentials.from_env(env, tls_ca=tls_ca)
    token = credentials.token
    if token:
        check_secret(token, "TASKD_JOB_TOKEN")
    elif nnodes == 1:
        token = secrets.token_urlsafe(32)
    elif not is_loopback(controller_host):
        raise ConfigError(
            "a job on several nodes needs TASKD_JOB_TOKEN: set it to the same secret on every node "
            "(see docs/security.md)"
        )
    else:
        logger.warning("TASKD_JOB_TOKEN is not set: the job registers without a token (legacy job)")
    return dataclasses.replace(credentials, token=token, launch=launch_identity(nnodes, shared, token))
