#!/usr/bin/env bash
# The test command: the whole suite as the calling user; when that is root, the suites that do
# not need root (the native sandbox suites, the init helper's and core's unit tests) run again as
# an unprivileged user, so the rootless path is tested too.
#
#   scripts/test.sh              # what CI runs (with TASKBOX_REQUIRE_ALL=1 set by scripts/ci.sh)
#   TASKBOX_ROOTLESS_USER=name   # the unprivileged account to use (created when missing)
set -euo pipefail
cd "$(dirname "$0")/.."

# The suites in tests/ drive the real binaries, which cargo does not build for another package's
# tests: build them first.
cargo build --workspace --bins

# The Python SDK's wheel test (tests/tests/python.rs) installs the wheel of scripts/wheel.sh into
# a fresh venv. Built from the debug build just made by default (seconds: nothing is compiled
# again); TASKBOX_WHEEL_PROFILE=release builds the wheel users get. Without maturin the
# wheel test skips (a failure under TASKBOX_REQUIRE_ALL=1).
if command -v maturin >/dev/null || python3 -m maturin --version >/dev/null 2>&1; then
  echo "== building the Python wheel (profile ${TASKBOX_WHEEL_PROFILE:-dev})"
  scripts/wheel.sh --profile "${TASKBOX_WHEEL_PROFILE:-dev}"
else
  echo "maturin not found: the Python wheel test will skip (pip install maturin)" >&2
fi

# The image-rooted variants of the suites (native with an image, docker) share one image store
# (root only): build the suite image into it and load it into Docker once, before the suites run
# in parallel. Without root, mmdebstrap or Docker the variants skip (or fail under
# TASKBOX_REQUIRE_ALL=1) with the reason.
if [ "$(id -u)" = 0 ] && command -v mmdebstrap >/dev/null; then
  export TASKBOX_TEST_IMAGE_DIR=${TASKBOX_TEST_IMAGE_DIR:-/var/tmp/taskbox-test-images}
  prep=$(mktemp -d /tmp/taskbox-images.XXXXXX)
  echo "== building the suite images into $TASKBOX_TEST_IMAGE_DIR"
  mkdir -p "$prep/state" "$prep/ws"
  for image in busybox debian-dev; do
    TASKBOX_IMAGE_DIR=$TASKBOX_TEST_IMAGE_DIR TASKBOX_STATE_DIR=$prep/state \
      target/debug/taskbox image build "$image"
  done
  if docker info >/dev/null 2>&1; then
    TASKBOX_IMAGE_DIR=$TASKBOX_TEST_IMAGE_DIR TASKBOX_STATE_DIR=$prep/state \
      target/debug/taskbox run --workspace "$prep/ws" --backend docker --image debian-dev -- true
  fi
  rm -rf "$prep"
fi

failed=0
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast || failed=1
else
  echo "cargo-nextest not found; using cargo test" >&2
  cargo test --workspace --no-fail-fast || failed=1
fi

if [ "$(id -u)" != 0 ]; then
  exit $failed
fi

user=${TASKBOX_ROOTLESS_USER:-taskbox-ci}
if ! id "$user" >/dev/null 2>&1; then
  useradd --create-home --shell /bin/bash "$user"
fi
home=$(getent passwd "$user" | cut -d: -f6)

# A setuid-root binary for the "setuid grants nothing" escape test (root creates it; the
# unprivileged run only tries it).
if [ ! -u /usr/local/lib/taskbox-test/suid-cat ]; then
  install -d /usr/local/lib/taskbox-test
  install -m 4755 /bin/cat /usr/local/lib/taskbox-test/suid-cat
fi

# The test executables and the binaries they drive, copied where the user can read them.
bindir=$(mktemp -d /tmp/taskbox-rootless.XXXXXX)
trap 'rm -rf "$bindir"' EXIT
chmod 755 "$bindir"
cp target/debug/taskbox target/debug/taskbox-init "$bindir/"
mapfile -t tests < <(cargo test --workspace --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") \
       and m.get("executable"):
        print(m["target"]["name"], m["executable"])
')
# The Python SDK's suite as the user too, on the native backend, under the venv scripts/ci.sh
# makes (TASKBOX_ROOTLESS_PYTHON_ENV): the tree it reads and the wheel are copied for the user
# (who owns the copy: inspect writes beside it); the tests that need root (an image store) or
# Docker are left out.
py_env=${TASKBOX_ROOTLESS_PYTHON_ENV:-/var/tmp/taskbox-rootless-py}
py_extra=()
if "$py_env/bin/python" -c 'import pytest, httpx, httpx_sse, pydantic, inspect_ai, minisweagent' 2>/dev/null; then
  tree="$bindir/tree"
  mkdir -p "$tree/runtime/contract/src" "$tree/runtime/server/src" "$tree/wheels"
  cp -r python "$tree/python"
  find "$tree/python" -name __pycache__ -prune -exec rm -rf {} +
  cp runtime/contract/src/api.rs "$tree/runtime/contract/src/"
  cp runtime/server/src/error.rs "$tree/runtime/server/src/"
  cp target/wheels/taskbox-*.whl "$tree/wheels/" 2>/dev/null || true
  chown -R "$user" "$tree"
  py_extra=(PATH="$py_env/bin:/usr/local/bin:/usr/bin:/bin" TASKBOX_REPO_DIR="$tree"
    TASKBOX_WHEEL_DIR="$tree/wheels" TASKBOX_PYTEST_K="not docker and not native-image")
else
  echo "no venv at $py_env with the Python suite's packages (scripts/ci.sh makes it): the" \
    "rootless pass of the Python suite is left out" >&2
  [ "${TASKBOX_REQUIRE_ALL:-0}" = 1 ] && failed=1
fi
# The suites that exercise the sandbox without root: the native conformance suites (of `run`
# and of the library API), the warm pool of forks, the escape and race suites, the
# supervisor's (its API, its connection front), the init helper's seccomp/Landlock tests, the
# workspace crate's real-overlay change scan and layer reads, the removal of a sandbox's
# directories, and the Python SDK's suite (above).
for entry in "${tests[@]}"; do
  target=${entry%% *}
  exe=${entry#* }
  case "$target" in
    conformance|escapes) filter=(--skip docker:: --skip native_image:: --skip with_an_image_root --skip on_the_docker_backend) ;;
    races|api_conformance) filter=(--skip docker:: --skip native_image::) ;;
    egress) filter=(--skip docker_) ;;
    traces) filter=(--skip an_exec_on_a_full_state_directory_is_refused_before_it_runs) ;;
    bad_input|api_native|disk|supervisor|native|front|fork_pool|taskbox_init|taskbox_protocol) filter=() ;;
    taskbox_workspace) filter=(changes:: layers:: tree::) ;;
    taskbox_kit) filter=(hostdirs::tests::a_tree_deeper) ;;
    python) [ ${#py_extra[@]} -gt 0 ] || continue; filter=() ;;
    *) continue ;;
  esac
  extra=()
  [ "$target" = python ] && extra=("${py_extra[@]}")
  name=$(basename "$exe")
  cp "$exe" "$bindir/$name"
  chmod 755 "$bindir/$name"
  echo "== rootless: $name (as $user)"
  if ! (cd "$bindir" && runuser -u "$user" -- env -i PATH=/usr/local/bin:/usr/bin:/bin \
        HOME="$home" USER="$user" LANG=C.UTF-8 TASKBOX_BIN_DIR="$bindir" \
        TASKBOX_REQUIRE_ALL="${TASKBOX_REQUIRE_ALL:-0}" "${extra[@]}" "./$name" "${filter[@]}"); then
    failed=1
  fi
done
exit $failed
