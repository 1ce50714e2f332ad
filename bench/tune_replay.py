#!/usr/bin/env python3
"""Replays `dnvme tune`'s coordinate descent over the points of a measured grid sweep.

    bench/tune_replay.py LOG_DIR/sweep.csv [--min-gain 0.03]

A grid run (`dnvme tune --search grid`) measures every point once. Feeding those same numbers to
the descent shows which point descent would have picked and how many points it would have paid
for, free of the run-to-run noise that comparing two separate runs would add. The search order
mirrors tools/dnvme/tune_search.cc (start at DeepNVMe's defaults; parameters in the order
intra_op_parallelism, queue_depth, block_size, overlap_events, single_submit; move only on a gain
above --min-gain; stop after a pass without a move, at most 4 passes).
"""
import argparse
import csv
import math
import statistics

KEYS = ["block_size", "queue_depth", "overlap_events", "single_submit", "intra_op_parallelism"]
ORDER = ["intra_op_parallelism", "queue_depth", "block_size", "overlap_events", "single_submit"]
DEFAULTS = {"block_size": 1 << 20, "queue_depth": 128, "overlap_events": 0, "single_submit": 0,
            "intra_op_parallelism": 1}


def score(row):
    w, r = float(row["write_gib_per_s"] or 0), float(row["read_gib_per_s"] or 0)
    return math.sqrt(w * r) if w > 0 and r > 0 else max(w, r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--min-gain", type=float, default=0.03)
    a = ap.parse_args()
    with open(a.csv) as f:
        rows = list(csv.DictReader(f))
    table = {tuple(int(r[k]) for k in KEYS): score(r) for r in rows}
    values = {k: sorted({int(r[k]) for r in rows}) for k in KEYS}
    cur = {k: DEFAULTS[k] if DEFAULTS[k] in values[k] else values[k][0] for k in KEYS}
    key = lambda p: tuple(p[k] for k in KEYS)  # noqa: E731
    seen = {key(cur)}
    for _ in range(4):
        moved = False
        for k in ORDER:
            best = dict(cur)
            for v in values[k]:
                cand = dict(cur, **{k: v})
                seen.add(key(cand))
                if table[key(cand)] > table[key(best)]:
                    best = cand
            if best != cur and table[key(best)] > table[key(cur)] * (1 + a.min_gain):
                cur, moved = best, True
        if not moved:
            break
    scores = sorted(table.values())
    top = max(table, key=table.get)
    # The tuner reports the best point it measured (which is where the descent ended, or a point
    # it passed that was better by less than --min-gain).
    picked = max(seen, key=table.get)
    print("grid: %d points, score min %.3f median %.3f max %.3f (max/median %.3f)" %
          (len(scores), scores[0], statistics.median(scores), scores[-1],
           scores[-1] / statistics.median(scores)))
    print("grid best:     %s score %.3f" % (dict(zip(KEYS, top)), table[top]))
    print("descent picks: %s score %.3f after %d points (%.1f%% of the grid's best; rank %d of %d)"
          % (dict(zip(KEYS, picked)), table[picked], len(seen), 100 * table[picked] / table[top],
             sorted(table.values(), reverse=True).index(table[picked]) + 1, len(scores)))


if __name__ == "__main__":
    main()
