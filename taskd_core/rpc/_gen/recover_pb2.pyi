from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Status(_message.Message):
    __slots__ = ("code", "info")
    CODE_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    code: int
    info: str
    def __init__(self, code: _Optional[int] = ..., info: _Optional[str] = ...) -> None: ...

class ClientInfo(_message.Message):
    __slots__ = ("jobId", "role", "agentId", "nodeRank", "rankIds", "progress")
    JOBID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    AGENTID_FIELD_NUMBER: _ClassVar[int]
    NODERANK_FIELD_NUMBER: _ClassVar[int]
    RANKIDS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    jobId: str
    role: str
    agentId: str
    nodeRank: int
    rankIds: _containers.RepeatedScalarFieldContainer[str]
    progress: str
    def __init__(self, jobId: _Optional[str] = ..., role: _Optional[str] = ..., agentId: _Optional[str] = ..., nodeRank: _Optional[int] = ..., rankIds: _Optional[_Iterable[str]] = ..., progress: _Optional[str] = ...) -> None: ...

class FaultRank(_message.Message):
    __slots__ = ("rankId", "faultType")
    RANKID_FIELD_NUMBER: _ClassVar[int]
    FAULTTYPE_FIELD_NUMBER: _ClassVar[int]
    rankId: str
    faultType: str
    def __init__(self, rankId: _Optional[str] = ..., faultType: _Optional[str] = ...) -> None: ...

class ProcessManageSignal(_message.Message):
    __slots__ = ("uuid", "jobId", "signalType", "actions", "faultRanks", "changeStrategy", "timeout", "nodeRankIds", "extraParams", "signalSeq", "cycle")
    UUID_FIELD_NUMBER: _ClassVar[int]
    JOBID_FIELD_NUMBER: _ClassVar[int]
    SIGNALTYPE_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    FAULTRANKS_FIELD_NUMBER: _ClassVar[int]
    CHANGESTRATEGY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    NODERANKIDS_FIELD_NUMBER: _ClassVar[int]
    EXTRAPARAMS_FIELD_NUMBER: _ClassVar[int]
    SIGNALSEQ_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    jobId: str
    signalType: str
    actions: _containers.RepeatedScalarFieldContainer[str]
    faultRanks: _containers.RepeatedCompositeFieldContainer[FaultRank]
    changeStrategy: str
    timeout: int
    nodeRankIds: _containers.RepeatedScalarFieldContainer[str]
    extraParams: str
    signalSeq: int
    cycle: int
    def __init__(self, uuid: _Optional[str] = ..., jobId: _Optional[str] = ..., signalType: _Optional[str] = ..., actions: _Optional[_Iterable[str]] = ..., faultRanks: _Optional[_Iterable[_Union[FaultRank, _Mapping]]] = ..., changeStrategy: _Optional[str] = ..., timeout: _Optional[int] = ..., nodeRankIds: _Optional[_Iterable[str]] = ..., extraParams: _Optional[str] = ..., signalSeq: _Optional[int] = ..., cycle: _Optional[int] = ...) -> None: ...

class StopCompleteRequest(_message.Message):
    __slots__ = ("jobId", "status", "faultRanks", "agentId", "uuid")
    JOBID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FAULTRANKS_FIELD_NUMBER: _ClassVar[int]
    AGENTID_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    jobId: str
    status: Status
    faultRanks: _containers.RepeatedCompositeFieldContainer[FaultRank]
    agentId: str
    uuid: str
    def __init__(self, jobId: _Optional[str] = ..., status: _Optional[_Union[Status, _Mapping]] = ..., faultRanks: _Optional[_Iterable[_Union[FaultRank, _Mapping]]] = ..., agentId: _Optional[str] = ..., uuid: _Optional[str] = ...) -> None: ...

class RecoverStrategyRequest(_message.Message):
    __slots__ = ("jobId", "faultRanks", "strategies", "agentId", "uuid")
    JOBID_FIELD_NUMBER: _ClassVar[int]
    FAULTRANKS_FIELD_NUMBER: _ClassVar[int]
    STRATEGIES_FIELD_NUMBER: _ClassVar[int]
    AGENTID_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    jobId: str
    faultRanks: _containers.RepeatedCompositeFieldContainer[FaultRank]
    strategies: _containers.RepeatedScalarFieldContainer[str]
    agentId: str
    uuid: str
    def __init__(self, jobId: _Optional[str] = ..., faultRanks: _Optional[_Iterable[_Union[FaultRank, _Mapping]]] = ..., strategies: _Optional[_Iterable[str]] = ..., agentId: _Optional[str] = ..., uuid: _Optional[str] = ...) -> None: ...

class RecoverStatusRequest(_message.Message):
    __slots__ = ("jobId", "status", "strategy", "isolateRankIds", "agentId", "uuid")
    JOBID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    ISOLATERANKIDS_FIELD_NUMBER: _ClassVar[int]
    AGENTID_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    jobId: str
    status: Status
    strategy: str
    isolateRankIds: _containers.RepeatedScalarFieldContainer[str]
    agentId: str
    uuid: str
    def __init__(self, jobId: _Optional[str] = ..., status: _Optional[_Union[Status, _Mapping]] = ..., strategy: _Optional[str] = ..., isolateRankIds: _Optional[_Iterable[str]] = ..., agentId: _Optional[str] = ..., uuid: _Optional[str] = ...) -> None: ...

class ProcessFaultRequest(_message.Message):
    __slots__ = ("jobId", "faultRanks", "agentId", "detail", "faultCodes", "startedCycle")
    class FaultCodesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOBID_FIELD_NUMBER: _ClassVar[int]
    FAULTRANKS_FIELD_NUMBER: _ClassVar[int]
    AGENTID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    FAULTCODES_FIELD_NUMBER: _ClassVar[int]
    STARTEDCYCLE_FIELD_NUMBER: _ClassVar[int]
    jobId: str
    faultRanks: _containers.RepeatedCompositeFieldContainer[FaultRank]
    agentId: str
    detail: str
    faultCodes: _containers.ScalarMap[str, str]
    startedCycle: int
    def __init__(self, jobId: _Optional[str] = ..., faultRanks: _Optional[_Iterable[_Union[FaultRank, _Mapping]]] = ..., agentId: _Optional[str] = ..., detail: _Optional[str] = ..., faultCodes: _Optional[_Mapping[str, str]] = ..., startedCycle: _Optional[int] = ...) -> None: ...

class AgentExitRequest(_message.Message):
    __slots__ = ("jobId", "agentId", "role", "status")
    JOBID_FIELD_NUMBER: _ClassVar[int]
    AGENTID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    jobId: str
    agentId: str
    role: str
    status: Status
    def __init__(self, jobId: _Optional[str] = ..., agentId: _Optional[str] = ..., role: _Optional[str] = ..., status: _Optional[_Union[Status, _Mapping]] = ...) -> None: ...

class JobPolicyRequest(_message.Message):
    __slots__ = ("jobId", "strategies", "recoveryEnabled", "reportTimeoutSeconds", "flushSeconds", "maxCycles", "expectedAgents")
    JOBID_FIELD_NUMBER: _ClassVar[int]
    STRATEGIES_FIELD_NUMBER: _ClassVar[int]
    RECOVERYENABLED_FIELD_NUMBER: _ClassVar[int]
    REPORTTIMEOUTSECONDS_FIELD_NUMBER: _ClassVar[int]
    FLUSHSECONDS_FIELD_NUMBER: _ClassVar[int]
    MAXCYCLES_FIELD_NUMBER: _ClassVar[int]
    EXPECTEDAGENTS_FIELD_NUMBER: _ClassVar[int]
    jobId: str
    strategies: _containers.RepeatedScalarFieldContainer[str]
    recoveryEnabled: bool
    reportTimeoutSeconds: float
    flushSeconds: float
    maxCycles: int
    expectedAgents: int
    def __init__(self, jobId: _Optional[str] = ..., strategies: _Optional[_Iterable[str]] = ..., recoveryEnabled: _Optional[bool] = ..., reportTimeoutSeconds: _Optional[float] = ..., flushSeconds: _Optional[float] = ..., maxCycles: _Optional[int] = ..., expectedAgents: _Optional[int] = ...) -> None: ...

class StatusQuery(_message.Message):
    __slots__ = ("jobId", "events")
    JOBID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    jobId: str
    events: int
    def __init__(self, jobId: _Optional[str] = ..., events: _Optional[int] = ...) -> None: ...

class AgentView(_message.Message):
    __slots__ = ("agentId", "role", "subscribed", "nodeRank", "exitState", "lastSeen", "progress")
    AGENTID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBED_FIELD_NUMBER: _ClassVar[int]
    NODERANK_FIELD_NUMBER: _ClassVar[int]
    EXITSTATE_FIELD_NUMBER: _ClassVar[int]
    LASTSEEN_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    agentId: str
    role: str
    subscribed: bool
    nodeRank: int
    exitState: str
    lastSeen: float
    progress: str
    def __init__(self, agentId: _Optional[str] = ..., role: _Optional[str] = ..., subscribed: _Optional[bool] = ..., nodeRank: _Optional[int] = ..., exitState: _Optional[str] = ..., lastSeen: _Optional[float] = ..., progress: _Optional[str] = ...) -> None: ...

class EventView(_message.Message):
    __slots__ = ("seq", "time", "cycle", "kind", "detail")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time: float
    cycle: int
    kind: str
    detail: str
    def __init__(self, seq: _Optional[int] = ..., time: _Optional[float] = ..., cycle: _Optional[int] = ..., kind: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class JobView(_message.Message):
    __slots__ = ("jobId", "state", "cycle", "strategy", "faultRanks", "cyclesUsed", "maxCycles", "strategies", "agents", "events", "outcome", "legacy", "slowRanks", "slowRankBound", "slowRankBoundLearned")
    JOBID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    FAULTRANKS_FIELD_NUMBER: _ClassVar[int]
    CYCLESUSED_FIELD_NUMBER: _ClassVar[int]
    MAXCYCLES_FIELD_NUMBER: _ClassVar[int]
    STRATEGIES_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    LEGACY_FIELD_NUMBER: _ClassVar[int]
    SLOWRANKS_FIELD_NUMBER: _ClassVar[int]
    SLOWRANKBOUND_FIELD_NUMBER: _ClassVar[int]
    SLOWRANKBOUNDLEARNED_FIELD_NUMBER: _ClassVar[int]
    jobId: str
    state: str
    cycle: int
    strategy: str
    faultRanks: _containers.RepeatedCompositeFieldContainer[FaultRank]
    cyclesUsed: int
    maxCycles: int
    strategies: _containers.RepeatedScalarFieldContainer[str]
    agents: _containers.RepeatedCompositeFieldContainer[AgentView]
    events: _containers.RepeatedCompositeFieldContainer[EventView]
    outcome: str
    legacy: bool
    slowRanks: _containers.RepeatedCompositeFieldContainer[SlowRankView]
    slowRankBound: float
    slowRankBoundLearned: bool
    def __init__(self, jobId: _Optional[str] = ..., state: _Optional[str] = ..., cycle: _Optional[int] = ..., strategy: _Optional[str] = ..., faultRanks: _Optional[_Iterable[_Union[FaultRank, _Mapping]]] = ..., cyclesUsed: _Optional[int] = ..., maxCycles: _Optional[int] = ..., strategies: _Optional[_Iterable[str]] = ..., agents: _Optional[_Iterable[_Union[AgentView, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[EventView, _Mapping]]] = ..., outcome: _Optional[str] = ..., legacy: _Optional[bool] = ..., slowRanks: _Optional[_Iterable[_Union[SlowRankView, _Mapping]]] = ..., slowRankBound: _Optional[float] = ..., slowRankBoundLearned: _Optional[bool] = ...) -> None: ...

class SlowRankView(_message.Message):
    __slots__ = ("rank", "pid", "ratio", "workSeconds", "peerWorkSeconds", "sinceStep", "since")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    WORKSECONDS_FIELD_NUMBER: _ClassVar[int]
    PEERWORKSECONDS_FIELD_NUMBER: _ClassVar[int]
    SINCESTEP_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    ratio: float
    workSeconds: float
    peerWorkSeconds: float
    sinceStep: int
    since: float
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., ratio: _Optional[float] = ..., workSeconds: _Optional[float] = ..., peerWorkSeconds: _Optional[float] = ..., sinceStep: _Optional[int] = ..., since: _Optional[float] = ...) -> None: ...

class ControllerStatus(_message.Message):
    __slots__ = ("status", "jobs", "leader", "leaderGeneration")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADERGENERATION_FIELD_NUMBER: _ClassVar[int]
    status: Status
    jobs: _containers.RepeatedCompositeFieldContainer[JobView]
    leader: str
    leaderGeneration: int
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., jobs: _Optional[_Iterable[_Union[JobView, _Mapping]]] = ..., leader: _Optional[str] = ..., leaderGeneration: _Optional[int] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("kind", "rank", "localRank", "pid", "time", "exitCode", "step")
    KIND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCALRANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    EXITCODE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    kind: str
    rank: int
    localRank: int
    pid: int
    time: float
    exitCode: int
    step: int
    def __init__(self, kind: _Optional[str] = ..., rank: _Optional[int] = ..., localRank: _Optional[int] = ..., pid: _Optional[int] = ..., time: _Optional[float] = ..., exitCode: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class WorkerEventsRequest(_message.Message):
    __slots__ = ("jobId", "agentId", "events", "work")
    JOBID_FIELD_NUMBER: _ClassVar[int]
    AGENTID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    jobId: str
    agentId: str
    events: _containers.RepeatedCompositeFieldContainer[WorkerEvent]
    work: _containers.RepeatedCompositeFieldContainer[RankWork]
    def __init__(self, jobId: _Optional[str] = ..., agentId: _Optional[str] = ..., events: _Optional[_Iterable[_Union[WorkerEvent, _Mapping]]] = ..., work: _Optional[_Iterable[_Union[RankWork, _Mapping]]] = ...) -> None: ...

class RankWork(_message.Message):
    __slots__ = ("rank", "pid", "step", "steps", "busySeconds")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BUSYSECONDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    step: int
    steps: int
    busySeconds: float
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., step: _Optional[int] = ..., steps: _Optional[int] = ..., busySeconds: _Optional[float] = ...) -> None: ...

class EventQuery(_message.Message):
    __slots__ = ("jobId", "afterSeq", "limit")
    JOBID_FIELD_NUMBER: _ClassVar[int]
    AFTERSEQ_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    jobId: str
    afterSeq: int
    limit: int
    def __init__(self, jobId: _Optional[str] = ..., afterSeq: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class EventPage(_message.Message):
    __slots__ = ("status", "events", "state")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    status: Status
    events: _containers.RepeatedCompositeFieldContainer[EventView]
    state: str
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., events: _Optional[_Iterable[_Union[EventView, _Mapping]]] = ..., state: _Optional[str] = ...) -> None: ...
