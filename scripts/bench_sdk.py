"""`scripts/bench.sh sdk`: `exec true` through the Python SDK against inspect-ai's `local` sandbox
(a plain subprocess), interleaved in rounds in one Python process, then sandbox create + destroy
through the SDK. Prints a JSON document of the figures (bench.sh turns it into table rows).

    python3 scripts/bench_sdk.py --socket SOCK --workspace DIR [--rounds 5] [--execs 200]

The SDK is the one of this tree (`python/src` first on sys.path) unless one is installed; the
supervisor is the one answering on SOCK (bench.sh starts it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "src"))

import taskbox  # noqa: E402
import taskbox.aio  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    """Nearest-rank percentile of `xs` (ms)."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(p / 100 * len(s) + 0.5)) - 1))
    return s[k]


def stats(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50": pct(xs, 50), "p99": pct(xs, 99), "mean": sum(xs) / len(xs)}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--workspace", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--execs", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--creates", type=int, default=40)
    ap.add_argument("--no-async", action="store_true", help="leave out the async client's figure")
    a = ap.parse_args()

    from inspect_ai.util._sandbox.local import LocalSandboxEnvironment

    local = LocalSandboxEnvironment()
    client = taskbox.Client(socket=a.socket, start_supervisor=False)
    aclient = taskbox.aio.AsyncClient(socket=a.socket, start_supervisor=False)
    sb = client.create(a.workspace)
    asb = await aclient.create(a.workspace)

    def sdk() -> None:
        r = sb.exec(["true"])
        if r.exit_code != 0:
            raise SystemExit(f"sdk exec true: exit {r.exit_code}")

    async def sdk_async() -> None:
        r = await asb.exec(["true"])
        if r.exit_code != 0:
            raise SystemExit(f"async sdk exec true: exit {r.exit_code}")

    async def loc() -> None:
        r = await local.exec(["true"])
        if not r.success:
            raise SystemExit(f"local exec true: {r.stderr}")

    sides: dict[str, list[float]] = {"sdk": [], "local": []}
    if not a.no_async:
        sides["sdk_async"] = []
    per_round: list[dict[str, float]] = []

    async def series(name: str) -> list[float]:
        async def one() -> None:
            if name == "sdk":
                sdk()
            elif name == "sdk_async":
                await sdk_async()
            else:
                await loc()

        for _ in range(a.warmup):
            await one()
        out = []
        for _ in range(a.execs):
            t0 = time.perf_counter()
            await one()
            out.append((time.perf_counter() - t0) * 1000)
        return out

    try:
        for r in range(a.rounds):
            order = list(sides)
            if r % 2 == 1:
                order.reverse()
            got = {}
            for name in order:
                got[name] = await series(name)
                sides[name].extend(got[name])
            per_round.append({k: pct(v, 50) for k, v in got.items()})
            print(
                f"   round {r + 1}/{a.rounds}: "
                + "  ".join(f"{k} p50 {pct(v, 50):.2f} ms" for k, v in got.items()),
                file=sys.stderr,
            )
    finally:
        sb.destroy(missing_ok=True)
        await asb.destroy(missing_ok=True)
        await aclient.close()

    creates = []
    for i in range(a.creates + 2):
        t0 = time.perf_counter()
        s = client.create(a.workspace)
        s.destroy()
        if i >= 2:
            creates.append((time.perf_counter() - t0) * 1000)
    client.close()

    ratios = [x["sdk"] / x["local"] for x in per_round]
    doc = {
        "execs_per_round": a.execs,
        "rounds": a.rounds,
        "sides": {k: stats(v) for k, v in sides.items()},
        "round_ratios": ratios,
        "create_destroy": stats(creates) if creates else None,
    }
    json.dump(doc, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    asyncio.run(main())
