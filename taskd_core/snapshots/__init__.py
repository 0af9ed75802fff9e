"""Memory snapshots that outlive the worker and its node, whatever the framework.

* :mod:`~taskd_core.snapshots.store`: a node's snapshots as files on a tmpfs, marker last, checksummed;
* :mod:`~taskd_core.snapshots.keeper`: the launcher's keeper process that owns them and removes them
  with the job (also when the launcher is SIGKILLed);
* :mod:`~taskd_core.snapshots.peer`: the keepers' authenticated wire (copies to and from other nodes);
* :mod:`~taskd_core.snapshots.pairing`: which ranks hold whose copies.

The PyTorch side (``torch.distributed.checkpoint`` storage) is ``taskd_pytorch.snapshot``.
"""
