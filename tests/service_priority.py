"""A daemon a test starts runs at the CPU share its systemd unit has on a node, not at the test tier's.

scripts/run_tiers.py runs the unit and tools tiers beside the lab in a session of their own at a lower share
(autogroup nice 5) and at nice 10. A daemon started from there inherits both and, beside the lab's busy vLLMs, shares
a sliver of a core with the tier's workers. HAProxy then runs late, and its clock advances less than real time (when
a poll returns over 100 ms after its timeout, HAProxy's clock.c takes it for a clock jump and counts the timeout
alone): its timeouts run long. A 2.5 s queue timeout, logged as 2.5 s, answered after 4.9 s. A unit's service is a
session of its own (its own share) at nice 0, as the daemon started here is.
"""

from __future__ import annotations

import os
from collections.abc import Callable

SERVICE_NICE = 0


def as_a_service(then: Callable[[], None] | None = None) -> Callable[[], None]:
    """What a child runs before its program (``preexec_fn``, with ``start_new_session=True``: a session, so a share,
    of its own): nice 0 (root may lower it), then ``then`` (a unit's memory rule, for example)."""

    def preexec() -> None:
        os.setpriority(os.PRIO_PROCESS, 0, SERVICE_NICE)
        if then is not None:
            then()

    return preexec
