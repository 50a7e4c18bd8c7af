#!/usr/bin/env bash
# Builds the Python wheel of python/: the `taskbox` package with the `taskbox` and
# `taskbox-init` binaries, so that `pip install taskbox-*.whl` puts both on the venv's PATH.
#
#   scripts/wheel.sh                    # a release wheel in TARGET/wheels
#   scripts/wheel.sh --profile dev      # from the debug build (fast when it is built already)
#   scripts/wheel.sh --out DIR
#
# Needs maturin (pip install maturin). maturin compiles `taskbox` itself; `taskbox-init` is
# another crate's binary, built here with the same profile and put in the wheel's data
# directory (python/build/wheel-data/scripts), which pip installs beside `taskbox`.
set -euo pipefail
cd "$(dirname "$0")/.."
profile=release
out=
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "usage: scripts/wheel.sh [--profile release|dev|NAME] [--out DIR]" >&2; exit 2 ;;
  esac
done
# maturin on PATH, else the one of python3's packages.
if command -v maturin >/dev/null; then
  maturin=(maturin)
elif python3 -m maturin --version >/dev/null 2>&1; then
  maturin=(python3 -m maturin)
else
  echo "scripts/wheel.sh: maturin not found (python3 -m pip install maturin)" >&2
  exit 1
fi
target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
case "$profile" in
  dev|test) dir=debug ;;
  bench) dir=release ;;
  *) dir=$profile ;;
esac
out=${out:-$target/wheels}

cargo build --profile "$profile" -p taskbox-init --bin taskbox-init
data=python/build/wheel-data/scripts
rm -rf python/build/wheel-data
mkdir -p "$data"
install -m 755 "$target/$dir/taskbox-init" "$data/taskbox-init"
# Only this build's wheel is left in OUT, so that whoever installs "the" wheel gets this one.
mkdir -p "$out"
rm -f "$out"/taskbox-*.whl
(cd python && "${maturin[@]}" build --quiet --profile "$profile" --target-dir "$target" --out "$out")
ls "$out"/taskbox-*.whl
