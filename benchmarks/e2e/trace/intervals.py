"""Interval arithmetic on one device's activities: unions, intersections, idle gaps, step starts.

Times are in ns; an interval is (start, end).
"""
from __future__ import annotations

def merge(intervals) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as disjoint intervals in start order."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(merged) -> float:
    return sum(b - a for a, b in merged)


def overlap(p, q) -> float:
    """The length of the intersection of two merged interval lists (both from merge())."""
    total, i, j = 0.0, 0, 0
    while i < len(p) and j < len(q):
        total += max(0.0, min(p[i][1], q[j][1]) - max(p[i][0], q[j][0]))
        if p[i][1] < q[j][1]:
            i += 1
        else:
            j += 1
    return total


def gaps(spans) -> list[tuple[float, str, str, str, str, float]]:
    """The idle gaps of one device: [(gap ns, kind before, kind after, name before, name after,
    start of the activity after)] for every stretch with no activity between its first start
    and its last end. spans: (start, end, kind, name) of every activity. The activity "before"
    a gap is the one whose end the gap starts at (with overlapping activities, the latest to
    end), the one "after" is the next to start."""
    out = []
    last = None  # (end, kind, name) of the activity that ends latest so far
    for start, end, kd, name in sorted(spans):
        if last is not None and start > last[0]:
            out.append((start - last[0], last[1], kd, last[2], name, start))
        if last is None or end > last[0]:
            last = (end, kd, name)
    return out


def step_starts(spans, steps: int) -> frozenset:
    """The start times of steps 2..n's first activities, from (start, ...) spans of n steps that
    each launch the same activities; empty when the count is not a multiple of n (the module
    doc, between)."""
    if steps < 2 or not spans or len(spans) % steps:
        return frozenset()
    starts = sorted(sp[0] for sp in spans)
    per = len(starts) // steps
    return frozenset(starts[k * per] for k in range(1, steps))
