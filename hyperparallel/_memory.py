"""What this process holds in memory, as the OS counts it (one home for the trainer and bench/)."""

from __future__ import annotations


def rss_bytes(peak: bool = False) -> int:
    """This process's resident set size from ``/proc/self/status``: now (``VmRSS``) or, with
    ``peak=True``, the most it has held since it started (``VmHWM``).

    Example::

        from hyperparallel._memory import rss_bytes
        print(rss_bytes() >> 20, "MiB now,", rss_bytes(peak=True) >> 20, "MiB at most")
    """
    field = "VmHWM:" if peak else "VmRSS:"
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) * 1024  # the kernel reports KiB
    raise RuntimeError(f"no {field} line in /proc/self/status: hyperparallel measures memory on Linux only")
