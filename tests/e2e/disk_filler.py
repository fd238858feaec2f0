#!/usr/bin/env python3
"""Test helper (tests/e2e/test_checkpoint_diskfull.sh): another writer on the checkpoint's disk.

disk_filler.py FILE: appends 4 KiB to FILE every millisecond, like a busy log; a write refused for
lack of space (ENOSPC) is counted and retried a millisecond later, so any space the disk gets back
is taken again at once. On SIGTERM it prints "wrote N bytes, K writes refused (ENOSPC)" and exits 0."""
import errno
import os
import signal
import sys
import time

fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
wrote = refused = 0


def done(*_):
    print(f"wrote {wrote} bytes, {refused} writes refused (ENOSPC)", flush=True)
    os._exit(0)


signal.signal(signal.SIGTERM, done)
block = b"\0" * 4096
while True:
    try:
        wrote += os.write(fd, block)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        refused += 1
    time.sleep(0.001)
