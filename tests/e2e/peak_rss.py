#!/usr/bin/env python3
"""peak_rss.py OUT CMD...: runs CMD and writes "STATUS PEAK_KIB" to OUT.<rank> (rank:
OMPI_COMM_WORLD_RANK, else 0): CMD's exit status (128 + N for signal N) and its peak resident set,
getrusage's ru_maxrss of the waited child (the kernel's VmHWM at its exit). Exits 0 itself, so that
under mpirun a rank's refusal does not make the launcher kill the other ranks' wrappers before they
have written theirs: the caller reads the statuses from the files."""
import os
import resource
import subprocess
import sys

rc = subprocess.call(sys.argv[2:])
rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
with open(f"{sys.argv[1]}.{rank}", "w") as f:
    f.write(f"{rc if rc >= 0 else 128 - rc} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}\n")
