#!/usr/bin/env python3
"""One exec on two supervisors, side by side: which build runs it faster.

    scripts/exec_ab.py --a A.sock --b B.sock --workspace DIR [--rounds N] -- CMD [ARG...]

Creates a sandbox on the workspace DIR through each supervisor's Unix socket (`taskbox serve
--socket ...`, one per build or per setting), then runs CMD in both, one after the other in an
order that alternates from round to round, after two rounds not counted. Each side's time is one
`POST /v1/sandboxes/ID/exec` on a kept-alive connection, as an API client pays it. Every run
must exit 0. Prints JSON: each side's median in ms, the median of the pairs' ratios A/B, the
ratio of the medians, and the quartiles of the pairs' ratios. Used for BENCHMARKS.md's figures
of one build against another (the findings section's `cat` of a 100 MB log).
"""

import argparse
import json
import statistics
import sys
import time

from bench_peers import UnixConnection


def call(conn, method, path, body=None):
    data = None if body is None else json.dumps(body)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.read()
    if r.status >= 300:
        raise SystemExit(f"exec_ab: {method} {path}: HTTP {r.status}: {out[:300]!r}")
    return json.loads(out) if out else None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", required=True, help="the first supervisor's socket")
    p.add_argument("--b", required=True, help="the second supervisor's socket")
    p.add_argument("--workspace", required=True, help="the workspace of both sandboxes")
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("argv", nargs="+", help="the command (after --)")
    a = p.parse_args()
    sides = []
    for sock in (a.a, a.b):
        conn = UnixConnection(sock)
        sb = call(conn, "POST", "/v1/sandboxes", {"workspace": a.workspace})
        sides.append((conn, sb["id"]))
    times = ([], [])
    try:
        for r in range(a.rounds + 2):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                conn, sid = sides[i]
                t = time.perf_counter()
                res = call(conn, "POST", f"/v1/sandboxes/{sid}/exec", {"argv": a.argv})
                ms = (time.perf_counter() - t) * 1000
                if res.get("exit_code") != 0:
                    raise SystemExit(f"exec_ab: {a.argv} exited {res.get('exit_code')}")
                if r >= 2:
                    times[i].append(ms)
    finally:
        for conn, sid in sides:
            try:
                call(conn, "DELETE", f"/v1/sandboxes/{sid}")
            except (SystemExit, OSError):
                pass
    ratios = sorted(x / y for x, y in zip(*times))
    ma, mb = statistics.median(times[0]), statistics.median(times[1])
    json.dump(
        {
            "argv": a.argv,
            "pairs": len(ratios),
            "a_ms": round(ma, 1),
            "b_ms": round(mb, 1),
            "median_of_ratios": round(statistics.median(ratios), 3),
            "ratio_of_medians": round(ma / mb, 3),
            "ratio_q1": round(ratios[len(ratios) // 4], 3),
            "ratio_q3": round(ratios[3 * len(ratios) // 4], 3),
        },
        sys.stdout,
    )
    print()


if __name__ == "__main__":
    main()
