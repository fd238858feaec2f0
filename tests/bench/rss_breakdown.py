"""Resident memory of running processes by mapping class, from /proc/PID/smaps.

Usage: rss_breakdown.py [--markdown] PID...   (run as the processes' user or root)

For each PID: Rss (resident), Pss (resident, pages shared with other processes divided among
them) and Private_Dirty (pages only this process wrote: what it costs on its own) in MB
(10^6 bytes), summed by the class of each mapping (see classify); classes under 0.05 MB are not
printed (the total counts them). Used for the "Resident memory
of a CPU rank" section of docs/benchmarks.md."""
import re
import sys

CLASSES = [  # (class, regex on the mapping's path), first match wins
    ("libcublasLt", r"/libcublasLt\.so"),
    ("libcublas", r"/libcublas\.so"),
    ("libnccl", r"/libnccl\.so"),
    ("libcudart", r"/libcudart\.so"),
    ("libcuda (driver)", r"/libcuda\.so"),
    ("libopenblas", r"/libopenblas"),
    ("libhdf5", r"/libhdf5"),
    ("MPI shared memory", r"^/dev/shm/|/ompi\.|vader|sm_segment|/openmpi-sessions"),
    ("MPI libraries and plugins", r"/libmpi|/libopen-(pal|rte)|/libpmix|/openmpi/|/libevent|/libhwloc|/libfabric|/libucx|/libuc[pst]|/libpsm|/libibverbs|/librdmacm|/libmunge"),
    ("shardtrain binary", r"/shardtrain$"),
    ("other shared libraries", r"\.so"),
    ("heap", r"^\[heap\]$"),
    ("stacks", r"^\[stack"),
    ("anonymous", r"^$"),
]
FIELDS = ("Rss", "Pss", "Private_Dirty")


def classify(path):
    for name, rx in CLASSES:
        if re.search(rx, path):
            return name
    return "other (" + path + ")"


def breakdown(pid):
    """{class: {field: bytes}}. An anonymous mapping that starts where a library's writable mapping
    ends is that library's zero-initialised data (.bss: the loader maps it so) and is counted as
    "<class> .bss"."""
    out, cur = {}, None
    head = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")
    prev_end, prev_class, prev_writable = None, None, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = head.match(line)
            if m:
                start, end, perms, path = int(m.group(1), 16), int(m.group(2), 16), m.group(3), m.group(4).strip()
                cls = classify(path)
                if path == "" and start == prev_end and prev_writable:
                    cls = prev_class + " .bss"
                cur = out.setdefault(cls, dict.fromkeys(FIELDS, 0))
                prev_end, prev_class, prev_writable = end, cls, perms.startswith("rw") and perms[3] == "p" and path.startswith("/") and not path.startswith("/dev/")
                continue
            k, _, v = line.partition(":")
            if k in FIELDS:
                cur[k] += int(v.split()[0]) * 1024
    return out


def main():
    md = "--markdown" in sys.argv
    pids = [a for a in sys.argv[1:] if a != "--markdown"]
    for pid in pids:
        b = breakdown(pid)
        tot = {k: sum(c[k] for c in b.values()) for k in FIELDS}
        rows = [kv for kv in sorted(b.items(), key=lambda kv: -kv[1]["Rss"]) if kv[1]["Rss"] >= 50_000]  # >= 0.05 MB
        if md:
            print(f"| PID {pid} | Rss MB | Pss MB | Private_Dirty MB |\n|---|---:|---:|---:|")
            for name, c in rows:
                print(f"| {name} | " + " | ".join(f"{c[k] / 1e6:.1f}" for k in FIELDS) + " |")
            print("| **total** | " + " | ".join(f"**{tot[k] / 1e6:.1f}**" for k in FIELDS) + " |")
        else:
            print(f"PID {pid}: {'Rss MB':>8} {'Pss MB':>8} {'PrivDirty MB':>12}")
            for name, c in rows:
                print(f"  {name:<36} {c['Rss'] / 1e6:8.1f} {c['Pss'] / 1e6:8.1f} {c['Private_Dirty'] / 1e6:12.1f}")
            print(f"  {'total':<36} {tot['Rss'] / 1e6:8.1f} {tot['Pss'] / 1e6:8.1f} {tot['Private_Dirty'] / 1e6:12.1f}")


if __name__ == "__main__":
    main()
