#!/usr/bin/env python3
"""Workloads under taskbox and its peers, interleaved: scripts/bench.sh peers.

Reads a JSON list of rows on stdin. A row is

    {"row": NAME, "cwd": DIR, "sides": [SIDE, ...], "rounds": N (optional)}

and its first side is the baseline the others are divided by. A side is one of

    {"label": L, "argv": [...]}                      a process, started and reaped
    {"label": L, "socket": S, "sandbox": ID, "argv": [...]}
                                                     an exec in a live sandbox: one
                                                     POST /v1/sandboxes/ID/exec on a
                                                     kept-alive connection to the
                                                     supervisor's Unix socket

Each round runs every side of a row once, in an order that rotates from round to round, so
a drift of the machine lands on all of them; WARMUP rounds are not counted. A process side is
started with posix_spawn and reaped with wait4, so each side pays the same cost of being
started from here, and the exec side pays the HTTP round trip an API client pays. Every run
must exit 0 (a side that fails is an error, not a figure). Prints JSON: per side the median,
minimum and maximum wall time in ms, the ratio of its median to the baseline's median, and
the lowest and highest ratio of a single round.
"""

import http.client
import json
import os
import socket
import statistics
import sys
import time


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost")
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)


def run_process(argv, cwd):
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        actions = [
            (os.POSIX_SPAWN_DUP2, devnull, 0),
            (os.POSIX_SPAWN_DUP2, devnull, 1),
            (os.POSIX_SPAWN_DUP2, devnull, 2),
        ]
        here = os.getcwd()
        os.chdir(cwd)
        try:
            t = time.perf_counter()
            pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=actions)
            _, status, _ = os.wait4(pid, 0)
            ms = (time.perf_counter() - t) * 1000
        finally:
            os.chdir(here)
    finally:
        os.close(devnull)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"bench_peers: {argv} in {cwd} exited {code}")
    return ms


class Exec:
    def __init__(self, side):
        self.conn = UnixConnection(side["socket"])
        self.path = f"/v1/sandboxes/{side['sandbox']}/exec"
        self.body = json.dumps({"argv": side["argv"]}).encode()
        self.argv = side["argv"]

    def run(self):
        t = time.perf_counter()
        self.conn.request(
            "POST", self.path, self.body, {"content-type": "application/json"}
        )
        r = self.conn.getresponse()
        data = r.read()
        ms = (time.perf_counter() - t) * 1000
        if r.status != 200:
            raise SystemExit(f"bench_peers: exec {self.argv}: HTTP {r.status}: {data[:300]!r}")
        result = json.loads(data)
        if result.get("exit_code") != 0:
            raise SystemExit(f"bench_peers: exec {self.argv} exited {result.get('exit_code')}: {data[:300]!r}")
        return ms


def main():
    all_rounds = int(os.environ.get("ROUNDS", "20"))
    warmup = int(os.environ.get("WARMUP", "3"))
    rows = json.load(sys.stdin)
    out = []
    for row in rows:
        rounds = min(all_rounds, row.get("rounds", all_rounds))
        sides = row["sides"]
        runners = []
        for s in sides:
            if "socket" in s:
                e = Exec(s)
                runners.append(e.run)
            else:
                runners.append(lambda s=s: run_process(s["argv"], row["cwd"]))
        times = [[] for _ in sides]
        for r in range(warmup + rounds):
            order = list(range(len(sides)))
            k = r % len(sides)
            order = order[k:] + order[:k]
            got = [0.0] * len(sides)
            for i in order:
                got[i] = runners[i]()
            if r >= warmup:
                for i, ms in enumerate(got):
                    times[i].append(ms)
        base = statistics.median(times[0])
        figures = []
        for i, s in enumerate(sides):
            med = statistics.median(times[i])
            per_round = [t / b for t, b in zip(times[i], times[0])]
            figures.append(
                {
                    "label": s["label"],
                    "median_ms": med,
                    "min_ms": min(times[i]),
                    "max_ms": max(times[i]),
                    "ratio": med / base,
                    "ratio_min": min(per_round),
                    "ratio_max": max(per_round),
                }
            )
        out.append({"row": row["row"], "rounds": rounds, "sides": figures})
        print(f"bench_peers: {row['row']}: done", file=sys.stderr)
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
