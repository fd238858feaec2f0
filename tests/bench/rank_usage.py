"""Runs one rank's command and records what it used: peak RSS and CPU seconds.

Usage: mpirun ... python3 tests/bench/rank_usage.py PREFIX -- COMMAND [ARGS...]

Writes PREFIX.rank<R>.json (R from OMPI_COMM_WORLD_RANK, else RANK, else 0) with the child's
exit status, its peak resident set (ru_maxrss, MiB) and its user + system CPU seconds, all threads
included, from wait4(2): the same figures for shardtrain and for the PyTorch peer, measured the
same way. The usage of processes the child started and waited for (torch.compile's workers) is
included by the kernel (RUSAGE_CHILDREN of the child); its peak RSS is the largest of them.
SIGTERM and SIGINT are passed on to the child. Exits with the child's status.
"""
import json
import os
import signal
import sys


def main():
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit(__doc__.split("\n\n")[1])
    prefix, cmd = sys.argv[1], sys.argv[3:]
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0"))
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(cmd[0], cmd)
        finally:
            os._exit(127)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    while True:
        try:
            _, status, ru = os.wait4(pid, 0)
            break
        except InterruptedError:
            continue
    rc = os.waitstatus_to_exitcode(status)
    with open(f"{prefix}.rank{rank}.json", "w") as f:
        json.dump({"rank": int(rank), "rc": rc, "maxrss_mib": ru.ru_maxrss / 1024.0,
                   "cpu_s": ru.ru_utime + ru.ru_stime}, f)
        f.write("\n")
    sys.exit(rc if rc >= 0 else 128 - rc)


if __name__ == "__main__":
    main()
