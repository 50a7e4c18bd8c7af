#!/usr/bin/env bash
# CI entry: provision what the tests need on a fresh Debian machine, check formatting and lints,
# then run exactly the README's test command (scripts/test.sh) with every skip made a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export TASKBOX_REQUIRE_ALL=1
export CARGO_TERM_COLOR=never
# A clean clone builds everything once: incremental caches would only double target/'s size.
export CARGO_INCREMENTAL=0

# System packages the suites use: python3 (escape probes), util-linux (unshare, mount), the
# Docker Engine (the docker backend), mmdebstrap (Debian-based images), busybox-static (the
# busybox image and test root filesystems) and chromium (the trace report's browser test, whose
# screenshot lands in target/artifacts/), openssl (the agent's HTTPS suites make their test CA),
# git and pytest under /usr/bin/python3 (the review checks run a test suite in host-view sandboxes,
# where only the system interpreter is seen), nats-server (the task queue's suites start real
# JetStream servers of their own, on loopback), iproute2 (the worker suites put workers in
# network namespaces of their own, on a bridge the test makes).
missing=()
[ -x /usr/bin/python3 ] || missing+=(python3)
/usr/bin/python3 -c 'import pytest' 2>/dev/null || missing+=(python3-pytest)
command -v git >/dev/null || missing+=(git)
command -v unshare >/dev/null || missing+=(util-linux)
command -v ip >/dev/null || missing+=(iproute2)
command -v runuser >/dev/null || missing+=(util-linux)
command -v useradd >/dev/null || missing+=(passwd)
command -v dockerd >/dev/null || missing+=(docker.io)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
[ -x /bin/busybox ] && /bin/busybox --list >/dev/null 2>&1 && ! ldd /bin/busybox >/dev/null 2>&1 \
  || missing+=(busybox-static)
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v openssl >/dev/null || missing+=(openssl)
[ -x /usr/sbin/nats-server ] || command -v nats-server >/dev/null || missing+=(nats-server)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
# The MCP client test (runtime/mcp) uses the Python MCP SDK under the python3 on PATH (which may
# be another interpreter than /usr/bin/python3): give that one pip if needed, then `mcp`.
python3 -c 'import mcp' 2>/dev/null || { python3 -m pip --version >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip; }; python3 -m pip install --quiet mcp || python3 -m pip install --quiet --break-system-packages mcp; }
# The Python SDK (python/) and its suite under the same python3: the SDK's dependency (pydantic),
# httpx and httpx-sse (the suite's own probes), pytest, and maturin, which builds the wheel that the suite installs into a
# fresh venv (scripts/test.sh builds it from the debug build it has just made, so CI compiles
# nothing twice; TASKBOX_WHEEL_PROFILE=release would add a release build of the whole tree).
# inspect-ai and mini-swe-agent: the harnesses whose adapters (taskbox.inspect,
# taskbox.minisweagent) the suite runs, inspect's own sandbox self-check among it, on native and
# on Docker with the debian-dev image (built below by scripts/test.sh; it carries adduser), and a
# small eval on inspect's mockllm model (part of inspect-ai; its outputs carry their token usage,
# so tiktoken never downloads an encoding).
py_pkgs=(httpx httpx-sse pydantic pytest maturin inspect-ai mini-swe-agent)
python3 -c 'import httpx, httpx_sse, pydantic, pytest, maturin, inspect_ai, minisweagent' >/dev/null 2>&1 || { python3 -m pip install --quiet "${py_pkgs[@]}" || python3 -m pip install --quiet --break-system-packages "${py_pkgs[@]}"; }
# The rootless pass of the Python suite (scripts/test.sh) runs under an interpreter the
# unprivileged user can read (the python3 on PATH may live in root's home): a venv of
# /usr/bin/python3 with the suite's packages, made once and kept.
rootless_py=${TASKBOX_ROOTLESS_PYTHON_ENV:-/var/tmp/taskbox-rootless-py}
if ! "$rootless_py/bin/python" -c 'import pytest, httpx, httpx_sse, pydantic, inspect_ai, minisweagent' >/dev/null 2>&1; then
  /usr/bin/python3 -c 'import ensurepip, venv' >/dev/null 2>&1 \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv; }
  rm -rf "$rootless_py"
  /usr/bin/python3 -m venv "$rootless_py"
  "$rootless_py/bin/python" -m pip install --quiet pytest httpx httpx-sse pydantic inspect-ai mini-swe-agent
fi
chmod -R a+rX "$rootless_py"
# The findings suite's tools (tests/tests/findings.rs): go, gcc, pytest, ruff, mypy, jest, vitest,
# tsc and eslint, where a host-view sandbox sees them; it prints what it installed.
scripts/findings-tools.sh

# The Docker backend's suites: a static busybox (their test image) and a running Docker Engine
# (Debian's docker.io). A dockerd started here is stopped at the end.
docker_missing=()
[ -x /bin/busybox ] || docker_missing+=(busybox-static)
command -v dockerd >/dev/null || docker_missing+=(docker.io)
if [ ${#docker_missing[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${docker_missing[@]}"
fi
started_dockerd=
if ! docker version >/dev/null 2>&1; then
  setsid dockerd </dev/null >/tmp/dockerd.log 2>&1 &
  started_dockerd=1
  for _ in $(seq 1 120); do docker version >/dev/null 2>&1 && break; sleep 0.5; done
  docker version >/dev/null 2>&1 || { echo "dockerd did not start:"; tail -20 /tmp/dockerd.log; exit 1; }
fi
stop_dockerd() {
  [ -n "$started_dockerd" ] || return 0
  local pid
  pid=$(pidof dockerd || true)
  [ -z "$pid" ] || { kill -TERM $pid; for _ in $(seq 1 60); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done; }
}
trap stop_dockerd EXIT

echo "== kernel $(uname -r); cgroups: $(stat -fc %T /sys/fs/cgroup)"
# The build and the suites' images need a few GiB; say how much there is before a full disk
# shows up as a linker's bus error.
free_mib=$(df -Pm . | awk 'NR == 2 { print $4 }')
echo "== disk: ${free_mib} MiB free where the build goes"
if [ "${free_mib:-0}" -lt 6144 ]; then
  echo "warning: under 6 GiB free; the build and the suite images may not fit" >&2
fi
cargo --version
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings

scripts/test.sh
