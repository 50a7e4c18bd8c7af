#!/usr/bin/env bash
# Fuzz taskbox's parsers of untrusted input with libFuzzer (cargo-fuzz), each target for a while,
# starting from the committed corpus (tests/fuzz/corpus/TARGET). What a run finds is written to
# tests/fuzz/artifacts/TARGET/; add the input to the target's corpus once it is fixed, and the
# suite's fuzz_corpus test keeps it fixed. The targets and the promise each checks are listed in
# tests/fuzz/src/lib.rs.
#
#   scripts/fuzz.sh                 # every target, FUZZ_SECONDS (default 60) each
#   scripts/fuzz.sh patch trace     # only these
#   FUZZ_SECONDS=600 FUZZ_JOBS=2 scripts/fuzz.sh proxy_request
#
# libFuzzer's instrumentation needs compiler flags that only nightly compilers take; with a
# stable toolchain the script sets RUSTC_BOOTSTRAP=1 for this build alone. cargo-fuzz is
# installed (cargo install cargo-fuzz) when missing. New inputs a run finds go to a scratch
# corpus (tests/fuzz/corpus-run/TARGET), not into the committed one.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-60}
jobs=${FUZZ_JOBS:-1}
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz
export RUSTC_BOOTSTRAP=1 CARGO_INCREMENTAL=0
# The file-system targets make a scratch tree per input: on tmpfs, when there is one, a run is
# bound by the code rather than the disk.
if [ -z "${TMPDIR:-}" ] && [ -d /dev/shm ] && [ -w /dev/shm ]; then
  export TMPDIR=/dev/shm
fi
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cargo fuzz list --fuzz-dir tests/fuzz)
fi
# No sanitizer: the targets are safe Rust over unsafe-free parsers, and what they check is their
# promises; debug assertions catch overflow.
cargo fuzz build --fuzz-dir tests/fuzz -s none -a
failed=()
for t in "${targets[@]}"; do
  run=tests/fuzz/corpus-run/$t
  mkdir -p "$run"
  echo "== $t: ${seconds}s"
  parallel=()
  [ "$jobs" -le 1 ] || parallel=(-jobs="$jobs" -workers="$jobs")
  if ! cargo fuzz run --fuzz-dir tests/fuzz -s none -a "$t" "$run" "tests/fuzz/corpus/$t" -- \
      -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
      "${parallel[@]}" -print_final_stats=1 2>&1 | tail -n 25; then
    failed+=("$t")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "broke a promise: ${failed[*]} (inputs in tests/fuzz/artifacts/)" >&2
  exit 1
fi
echo "no target broke a promise"
