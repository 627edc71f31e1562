"""Named points where a test can kill the ingest, to prove that a kill there loses nothing.

``HUB_INGEST_FAILPOINT=<name>`` sends SIGKILL to the ingest the first time it reaches
`<name>`: the driver, the JVM and Spark's Python workers die together, as in a power cut or
an OOM kill. The ingest must lead its own session (a test starts it so); Spark's Python
daemon makes its own process group, which is killed with it. On a Spark cluster an
executor's session is its worker's: set in one worker's environment (executors inherit it), a
point reached on an executor kills that worker, its executors and their Python workers, as a
machine that dies (the worker must lead its own session; `tests/support/sparkcluster.py`
starts them so). Unset, `reach` costs one dictionary look-up.

- ``before_write``: a batch is about to be written (its offsets are in the checkpoint);
- ``mid_write``: an executor starts a partition past a stream's first message (the batch's
  write job has begun; with several partitions, others may be written);
- ``before_commit``: the batch's files are written, the table does not list them yet;
- ``after_commit``: the table lists them, Spark's commit log does not have the batch yet.

And in ``device add --from`` (`ENROL_POINTS`), ``mid_enrol``: half the new devices are in the
registry, the users file and the streams are not updated yet.
"""

from __future__ import annotations

import os
import signal

VARIABLE = "HUB_INGEST_FAILPOINT"
POINTS = ("before_write", "mid_write", "before_commit", "after_commit")
ENROL_POINTS = ("mid_enrol",)


def reach(point: str) -> None:
    if os.environ.get(VARIABLE) == point:
        own, session = os.getpgrp(), os.getsid(0)
        if session != own:  # a Python worker: the JVMs (driver or Spark worker) first
            os.killpg(session, signal.SIGKILL)
        os.killpg(own, signal.SIGKILL)
