"""Live recovery for data-parallel PyTorch: healthy ranks never exit, nothing committed is lost.

This is the worker's API and its reference. A script opts in by naming its
state and running its steps through a :class:`LiveSession`; ``taskdrun`` and
the TaskD controller do the rest::

    from taskd_pytorch.live import LiveSession

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    done = load_checkpoint(...)                       # as before: every start may resume
    session = LiveSession(model=model, optimizer=optimizer)   # instead of init_process_group
    session.start(done)                               # a replacement receives the live state here
    for step in session.steps(total_steps):
        with step:                                    # commits when the block ends cleanly
            loss = loss_fn(model(batch(step.number)), ...)
            loss.backward()
            session.all_reduce(grads)                 # or dist.all_reduce on the default group
            optimizer.step()
            if step.number % 100 == 0: save_checkpoint(...)
    session.close()

What happens when a rank is lost (killed, crashed, or stopped and then
killed by its agent):

1. The other ranks' collective fails at once (a dead peer's connection is
   closed); one blocked on a stopped peer is left when the node agent
   announces the next round (:meth:`LiveSession.all_reduce` waits in short
   slices and looks). The failed step is not committed, nothing else happens
   to the healthy processes: same pids, same imported modules, same memory.
2. The node agent that sees a rank die starts it again at once, with the
   same ``RANK`` and environment (warm, from the fork server, where one
   runs), when every local worker uses this API. The replacement finds that
   its rank's last round is the current one and waits for the next.
   Meanwhile the controller chooses ``recover-live`` when every node's
   workers use this API; each node agent announces round *n* (the
   controller's cycle number) through the node's channel directory
   (``TASKD_LIVE_DIR``) and starts the lost local ranks it has not started
   yet. Any other strategy stops the early replacement with the rest.
3. Every rank forms a new process group in a fresh key space of the job's
   store (``taskd/live/<restart>/<round>/``). The ranks exchange their
   committed step; the live replica with the most steps sends the registered
   state to every rank that is new or behind over a TCP connection of their
   own (its address published, signed, in the round's store): from its
   tensors' memory into the receiver's tensors, encrypted and authenticated
   with a key from the job's token, ``TASKD_JOB_TOKEN`` (the wire:
   ``taskd_pytorch.live._state``; a job of several nodes needs the token
   for live recovery, a one-node ``taskdrun`` makes one).
4. The interrupted step runs again on every rank; no committed step is lost.

If a round cannot be formed in time (the node's ``--taskd-live-timeout``),
the node reports the strategy as failed and the controller falls back to a
full restart from the checkpoint, as without this API. A round that breaks
as it forms (a peer lost during the state's hand-over; a whole node lost:
docs/node-loss.md) is reported failed at once: each worker it broke under
marks it in the channel and waits for the next round (a receiver that got
part of the state ends instead, and its replacement loads the checkpoint). So does a rank that
dies while the round forms, after the controller chose the strategy (later
than the controller's flush window, ``--taskd-flush-seconds``, after the
cycle's first fault): its node reports the round failed at once, the other
nodes when their ``--taskd-live-timeout`` passes.

Rules for the training step, so that a replica's state is always a committed one:

* change registered state only after the step's last collective (what DDP
  plus ``optimizer.step()`` and the hand-written all-reduce of
  ``examples/train_live.py`` do);
* derive per-rank randomness (data order, dropout) from the step and the
  rank, not from a private generator that a lost rank takes with it;
* the session owns the default process group: call no
  ``init_process_group`` or ``destroy_process_group`` of your own. A model
  wrapped in ``DistributedDataParallel`` is bound to one group; wrap it again
  after a rebuild (compare ``session.round`` with the round you wrapped in).
* DDP reduces the gradients inside ``backward()``, where no Python code of
  the session runs: register :attr:`LiveSession.ddp_comm_hook` on each
  wrapper (``ddp.register_comm_hook(None, session.ddp_comm_hook)``). A rank
  blocked there on peers that left (with more than two ranks, one whose ring
  neighbours survive the loss) then leaves the all-reduce as soon as its
  agent announces the next round; without the hook it waits for the group's
  timeout and the round falls back to a full restart.

Sharded state (FSDP2's ``fully_shard``, ``ZeroRedundancyOptimizer``) has no
replica to hand over: ``LiveSession(sharded=True, snapshot_every=K)`` instead
snapshots it to the node keeper's memory after every K-th committed step
(``dcp.async_save`` through :mod:`taskd_pytorch.snapshot`), and
:meth:`LiveSession.restore` loads, on every rank, the newest step all ranks
can get (own memory, a peer's copy, the disk checkpoint). Such a session does
not opt into recovery in place: a lost rank restarts every rank (warm), each
restoring that step (``docs/snapshots.md``, ``examples/train_fsdp_live.py``)::

    session = LiveSession(sharded=True)
    session.start()
    model, optimizer = build()                       # fully_shard on the session's group
    done = session.restore(state, load, fallback)    # state(step) -> DCP dict; load(dict) -> step
    for step in session.steps(total_steps):
        with step:
            train(step.number)                       # each commit starts the step's snapshot

Without ``TASKD_LIVE_DIR`` (plain ``torchrun``, ``taskd run``) the session
still trains; a lost peer then fails the step as usual and the launcher's
own recovery takes over.
"""

from taskd_pytorch.live._session import LiveRecoveryError, LiveSession, LiveStep, PeerLost
from taskd_pytorch.live._state import StateTransferError

__all__ = ["LiveRecoveryError", "LiveSession", "LiveStep", "PeerLost", "StateTransferError"]
