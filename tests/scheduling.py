"""Which pytest-xdist worker runs which test file: a lane of its own for the files that mostly wait.

``make test`` runs each file whole on one worker (``--dist loadfile``), one worker per core. A few files
spend most of their time waiting, not computing: replica groups for quorums, heartbeats and restarted
groups, the Slurm tests for Slurm's scheduler, others for a hang's timeout or a server's start. On a core's
worker that wait leaves the core idle. With a worker more than there are cores (``make test`` starts 3 on
this 2-core machine), the last worker to come up is the waiting lane: it runs those files first, while the
others run the rest, one per core; once they are done it takes the queue's next file as any worker does, and
the others take any waiting file the lane has not started.
"""

from __future__ import annotations

import os

from xdist.scheduler import LoadFileScheduling

# Files whose time is mostly waiting (CPU-seconds a small part of their seconds in the session's summary).
WAITING_FILES = (  # the longest first: the lane's order
    "tests/integration/test_replica_groups.py",  # about 45 CPU-s in 190 s
    "tests/slurm/test_real_slurm.py",  # about 4 CPU-s in 70 s
    "tests/integration/test_mlflow_server.py",  # 13 CPU-s in 25 s: the server's start
    "tests/integration/test_lm_resume.py",  # 3.5 CPU-s in 15 s: loader workers' timeouts
    "tests/integration/test_hang.py",  # 1 CPU-s in 5.5 s: the hang timeout
    "tests/unit/test_stuck_vote.py",  # 0.4 CPU-s in 5 s: a vote's grace
)


class WaitingLaneScheduling(LoadFileScheduling):
    """``--dist loadfile`` with the last worker up running ``WAITING_FILES`` first where there are more workers
    than cores; otherwise loadfile's own order."""

    def _assign_work_unit(self, node) -> None:
        self.workqueue.move_to_end(self._next_scope(node), last=False)  # loadfile assigns the queue's first
        super()._assign_work_unit(node)

    def _next_scope(self, node) -> str:
        """The waiting lane's next waiting file, another worker's next file that is not one; where a lane has
        none of its own left, the queue's next file."""
        queue = list(self.workqueue)
        if len(self.nodes) <= len(os.sched_getaffinity(0)):
            return queue[0]
        if node is self.nodes[-1]:
            waiting = [scope for scope in WAITING_FILES if scope in self.workqueue]
            return (waiting or queue)[0]
        computing = [scope for scope in queue if scope not in WAITING_FILES]
        return (computing or queue)[0]
