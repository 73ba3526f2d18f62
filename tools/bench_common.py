"""Helpers shared by the benchmark commands."""


def peak_rss_mb():
    """Peak resident memory of this process alone, in MB (VmHWM). Not ru_maxrss: Linux keeps that across
    fork+exec, so a spawned worker would report its parent's peak whenever the parent's was higher."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")
