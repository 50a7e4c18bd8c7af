"""A long test log with one failure in its middle, as `cargo test --workspace --no-fail-fast`
prints it: many test binaries of passing tests, one of which has a failing `assert_eq!`. For
`scripts/bench.sh findings` (the cost of reading findings, and what the model reads) and the
suite's long-log test.

    python3 scripts/findings_log.py --mb 100 > log      # about 100 MB on stdout

The failing test is `calc::tests::adds_two` at `src/calc.rs:12:9`.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=100)
    a = ap.parse_args()
    want = int(a.mb * 1_000_000)
    out = sys.stdout
    written, k, failed = 0, 0, False
    while written < want:
        if not failed and written >= want // 2:
            out.write(FAILURE)
            written += len(FAILURE)
            failed = True
            continue
        chunk = binary(k, 2000)
        out.write(chunk)
        written += len(chunk)
        k += 1
    out.flush()


if __name__ == "__main__":
    main()
