"""Who may do what to a job: the controller's authorisation rules, free of I/O.

A job's first registration (``Init``) *claims* it: the digest of the job
token the caller sent and its launch identity are bound to the job. After
that, every RPC for the job must present the same token; a registration
from another launch is refused while the job is live, and one with another
token as long as the job has not ended (the admin token excepted). Each
claim sees the journal from its own start on: whoever claims an ended job's
id next does not read the previous run's journal. A job registered
without a token is a *legacy* job, allowed only where the controller allows
legacy clients; anyone who reaches the controller can act on it.

The admin token (``--admin-token-file``) may list and change every job.
Without one, listing shows legacy jobs and the caller's own, and a policy
may be set only for existing legacy jobs or with the job's own token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from taskd_core.errors import RequestRejected
from taskd_core.models import PERMISSION_DENIED_INFO, Code
from taskd_core.rpc.security import Caller, token_digest, token_matches


@dataclass(frozen=True, slots=True)
class AccessRules:
    """A controller's authorisation settings."""

    #: SHA-256 digest of the admin token; empty: no admin token.
    admin_digest: str = field(default="", repr=False)
    #: accept jobs registered without a token (reference-style clients).
    allow_legacy: bool = True
    #: digest of the one job token this controller serves (a launch's embedded controller); empty: any.
    only_digest: str = field(default="", repr=False)

    def is_admin(self, caller: Caller) -> bool:
        return token_matches(self.admin_digest, caller.token)


@dataclass(frozen=True, slots=True)
class Claim:
    """Who owns a job: its token digest (empty: a legacy job), the launch that registered it, and when."""

    token_digest: str = field(default="", repr=False)
    launch: str = ""
    #: when the claim was made (the controller's clock): its journal view starts there.
    since: float = 0.0

    @property
    def legacy(self) -> bool:
        return not self.token_digest

    @classmethod
    def of(cls, caller: Caller, since: float = 0.0) -> Claim:
        return cls(token_digest(caller.token) if caller.token else "", caller.launch, since)

    def owned_by(self, caller: Caller) -> bool:
        """The caller holds this job's token (any caller, for a legacy job without one)."""
        return self.legacy or token_matches(self.token_digest, caller.token)

    def same_launch(self, caller: Caller) -> bool:
        """Callers that say which launch they belong to must name this job's launch."""
        return not (self.launch and caller.launch and self.launch != caller.launch)


def forbidden(job_id: str, reason: str) -> RequestRejected:
    return RequestRejected(Code.FORBIDDEN, f"jobId={job_id}: {PERMISSION_DENIED_INFO}: {reason}")


def check_claim(job_id: str, claim: Claim, caller: Caller) -> None:
    """Raise the refusal for a caller that may not act on a job claimed as ``claim``."""
    if not claim.owned_by(caller):
        missing = "no job token was sent" if not caller.token else "the job token does not match"
        raise forbidden(
            job_id,
            f"{missing}; every node of a job must send the same TASKD_JOB_TOKEN "
            "as the launch that started it (a job of another token keeps its id until it ends: "
            "pick another job id)",
        )
    if claim.legacy and caller.token:
        raise forbidden(
            job_id,
            "the job was registered without a token by another client; run yours under a different job id",
        )
    if not claim.same_launch(caller):
        raise forbidden(
            job_id,
            f"the job id is in use by another live launch ({claim.launch}); "
            "pick another job id or wait until that launch ends",
        )


def check_new_claim(job_id: str, rules: AccessRules, caller: Caller) -> None:
    """Refuse a registration without a token where legacy clients are refused, or with a foreign token."""
    if rules.only_digest and not token_matches(rules.only_digest, caller.token):
        raise forbidden(
            job_id,
            "this controller is embedded in one launch and serves only that launch's job token; "
            "run your job under its own launcher or a `taskd controller`",
        )
    if not caller.token and not rules.allow_legacy:
        raise forbidden(
            job_id,
            "this controller refuses clients without a job token: set TASKD_JOB_TOKEN "
            "(or start the controller with --allow-legacy-clients)",
        )


def journal_since(rules: AccessRules, claim: Claim | None, caller: Caller) -> float:
    """The oldest journal time a caller who may see the job reads: its claim's start (the admin: all)."""
    return 0.0 if claim is None or rules.is_admin(caller) else claim.since


def may_see(rules: AccessRules, claim: Claim | None, caller: Caller) -> bool:
    """Whether QueryStatus shows a job to this caller."""
    if rules.is_admin(caller):
        return True
    if claim is None:
        return False
    if claim.legacy:
        return rules.allow_legacy
    return claim.owned_by(caller)


def check_policy_change(
    job_id: str, rules: AccessRules, claim: Claim | None, exists: bool, caller: Caller
) -> None:
    """SetJobPolicy: the admin; the job's own token; or, in legacy mode, anyone for an existing legacy job."""
    if rules.is_admin(caller):
        return
    if claim is not None and not claim.legacy and claim.owned_by(caller):
        return
    if exists and claim is not None and claim.legacy and rules.allow_legacy and not rules.admin_digest:
        return
    raise forbidden(
        job_id,
        "changing this job's policy needs the admin token (the controller's --admin-token-file) "
        "or the job's own token",
    )
