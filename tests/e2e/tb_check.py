"""Reads a --tensorboard directory with TensorBoard's own EventAccumulator (purge_orphaned_data on,
as `tensorboard --logdir` loads a run) and compares it with a --metrics file: every (tag, step,
value) of the metrics file is there once, and nothing else. Tags follow docs/monitoring.md's map (the same
rules as src/io/tensorboard.cpp's tensorboard_tag); values are float32 (simple_value).

usage: tb_check.py LOGDIR METRICS [--files N] [--raw-steps-over S]
  --files N          LOGDIR holds exactly N event files
  --raw-steps-over S the files hold (before purging) events of steps > S that the accumulator dropped
"""
import argparse, glob, json, math, os, sys

import numpy as np
from tensorboard.backend.event_processing import event_file_loader
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator, SCALARS


def tag_of(key):
    if key == "loss":
        return "train/loss"
    if key.startswith("val_"):
        return "val/" + key[4:]
    perf = (key.endswith(("_s", "_ms", "_per_s", "_bytes", "_mib", "_gib")) or "_ms_" in key or "mem" in key
            or "mfu" in key or "rank" in key)
    return ("perf/" if perf else "train/") + key


def f32(v):
    return float(np.float32(float("nan") if v is None else float(v)))


ap = argparse.ArgumentParser()
ap.add_argument("logdir")
ap.add_argument("metrics")
ap.add_argument("--files", type=int)
ap.add_argument("--raw-steps-over", type=int)
a = ap.parse_args()

files = sorted(glob.glob(os.path.join(a.logdir, "events.out.tfevents.*")))
if a.files is not None:
    assert len(files) == a.files, f"{len(files)} event files, expected {a.files}: {files}"
writers = {tuple(os.path.basename(f).split(".")[4:6]) for f in files}  # (host, pid)

want = {}
for line in open(a.metrics):
    r = json.loads(line)
    for k, v in r.items():
        if k == "step" or isinstance(v, (str, list, dict)):
            continue
        key = (tag_of(k), r["step"])
        assert key not in want, f"the metrics file holds {key} twice"
        want[key] = f32(v)

acc = EventAccumulator(a.logdir, size_guidance={SCALARS: 0})
acc.Reload()
got = {}
for tag in acc.Tags()["scalars"]:
    for e in acc.Scalars(tag):
        assert (tag, e.step) not in got, f"TensorBoard shows {tag} at step {e.step} twice"
        got[(tag, e.step)] = e.value
missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
assert not missing and not extra, f"missing in TensorBoard: {missing[:8]}; extra: {extra[:8]}"
bad = [(k, want[k], got[k]) for k in want
       if not (want[k] == got[k] or (math.isnan(want[k]) and math.isnan(got[k])))]
assert not bad, f"values differ (metrics file, TensorBoard): {bad[:8]}"

raw_over = 0
if a.raw_steps_over is not None:
    for f in files:
        for ev in event_file_loader.EventFileLoader(f).Load():
            if ev.HasField("summary") and ev.step > a.raw_steps_over:
                raw_over += len(ev.summary.value)
    assert raw_over > len([k for k in want if k[1] > a.raw_steps_over]), \
        "the event files hold no extra events after the checkpoint: the purge was not exercised"
tags = sorted({t for t, _ in want})
steps = sorted({s for _, s in want})
print(f"ok: {a.logdir}: {len(files)} event file(s) from {len(writers)} writer(s), {len(got)} scalars = the metrics "
      f"file's, each (tag, step) once; tags {', '.join(tags)}; steps {steps[0]}-{steps[-1]}"
      + (f"; {raw_over} scalars after step {a.raw_steps_over} in the files (incl. the crashed run's), purged"
         if a.raw_steps_over is not None else ""))
