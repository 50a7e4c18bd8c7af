"""A long test log with one failure in its middle, as `cargo test --workspace --no-fail-fast`
prints it: many test binaries of passing tests, one of which has a failing `assert_eq!`. For
`scripts/bench.sh findings` (the cost of reading findings, and what the model reads) and the
suite's long-log test.

    python3 scripts/findings_log.py --mb 100 > log      # about 100 MB on stdout
    python3 scripts/findings_log.py --mb 100 --format go > log

The failing test is `calc::tests::adds_two` at `src/calc.rs:12:9`. With `--format go`, the log
is `go test -v ./...` of many packages: tests of varied names, some with subtests, one in twenty
logging a line, and `TestCalc/adds_two` failing at `calc_test.go:12` (the same each run).
"""

from __future__ import annotations

import argparse
import random
import sys

FAILURE = """running 3 tests
test calc::tests::adds_one ... ok
test calc::tests::adds_two ... FAILED
test calc::tests::adds_three ... ok

failures:

---- calc::tests::adds_two stdout ----

thread 'calc::tests::adds_two' panicked at src/calc.rs:12:9:
assertion `left == right` failed
  left: 3
 right: 4
note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace


failures:
    calc::tests::adds_two

test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s

"""


def binary(k: int, tests: int) -> str:
    lines = [f"     Running unittests src/lib.rs (target/debug/deps/crate_{k}-0123456789abcdef)\n",
             f"running {tests} tests\n"]
    lines += [f"test module_{k}::tests::case_{j:05} ... ok\n" for j in range(tests)]
    lines.append(f"\ntest result: ok. {tests} passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.02s\n\n")
    return "".join(lines)


WORDS = (
    "Parse Format URL Host Port Empty Nil Error Handler Request Response Body Header Cookie Cache "
    "Encode Decode JSON Config Load Save Read Write Close Open Timeout Retry Backoff Context "
    "Cancel Deadline Server Client Conn Dial Listen Accept Route Match Path Query Escape Token "
    "Auth Session Store Get Set Delete List Update Create Merge Split Join Trim Compare Equal "
    "Hash Sum Count Limit Offset Page Sort Filter Map Batch Stream Buffer Pool Worker Queue Job "
    "Task Event Signal Lock Mutex Atomic Race Recover Flush Sync"
).split()
CASES = (
    "empty_input valid_host missing_port bad_scheme nil_body large_payload unicode_name "
    "zero_value negative_count max_int trailing_slash with_query no_query ascii_only long_name"
).split()

GO_FAILURE = """=== RUN   TestCalc
=== RUN   TestCalc/adds_one
=== RUN   TestCalc/adds_two
    calc_test.go:12: Add(1, 1) = 3, want 2
--- FAIL: TestCalc (0.00s)
    --- PASS: TestCalc/adds_one (0.00s)
    --- FAIL: TestCalc/adds_two (0.00s)
FAIL
FAIL	example.com/project/calc	0.004s
"""


def go_package(rng: random.Random, k: int) -> str:
    """One package's `go test -v` output, every test passing."""
    lines = []
    for _ in range(rng.randint(20, 400)):
        name = "Test" + "".join(rng.sample(WORDS, rng.randint(1, 3)))
        lines.append(f"=== RUN   {name}\n")
        subs = rng.sample(CASES, rng.randint(1, 4)) if rng.random() < 0.3 else []
        lines += [f"=== RUN   {name}/{c}\n" for c in subs]
        if rng.random() < 0.05:
            lines.append(f"    {name[4:12].lower()}_test.go:{rng.randint(10, 400)}: checked {rng.choice(CASES)}\n")
        lines.append(f"--- PASS: {name} ({rng.random() * 0.05:.2f}s)\n")
        lines += [f"    --- PASS: {name}/{c} (0.00s)\n" for c in subs]
    lines.append(f"PASS\nok  \texample.com/project/pkg{k}\t{rng.random() * 3:.3f}s\n")
    return "".join(lines)


def write(out, want: int, failure: str, package) -> None:
    """Packages (`package(k)`, k counting them) until `want` bytes, `failure` once half are."""
    written, k, failed = 0, 0, False
    while written < want:
        if not failed and written >= want // 2:
            chunk, failed = failure, True
        else:
            chunk, k = package(k), k + 1
        out.write(chunk)
        written += len(chunk)
    out.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=100)
    ap.add_argument("--format", choices=["cargo", "go"], default="cargo")
    a = ap.parse_args()
    want = int(a.mb * 1_000_000)
    if a.format == "go":
        rng = random.Random(16)
        write(sys.stdout, want, GO_FAILURE, lambda k: go_package(rng, k))
    else:
        write(sys.stdout, want, FAILURE, lambda k: binary(k, 2000))


if __name__ == "__main__":
    main()
