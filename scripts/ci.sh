#!/usr/bin/env bash
# CI entry: provision what the tests need on a fresh Debian machine, check formatting and lints,
# then run exactly the README's test command (scripts/test.sh) with every skip made a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export TASKBOX_REQUIRE_ALL=1
export CARGO_TERM_COLOR=never

# System packages the suites use: python3 (escape probes), util-linux (unshare, mount), the
# Docker Engine (the docker backend), mmdebstrap (Debian-based images) and busybox-static (the
# busybox image and test root filesystems).
missing=()
[ -x /usr/bin/python3 ] || missing+=(python3)
command -v unshare >/dev/null || missing+=(util-linux)
command -v runuser >/dev/null || missing+=(util-linux)
command -v useradd >/dev/null || missing+=(passwd)
command -v dockerd >/dev/null || missing+=(docker.io)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
[ -x /bin/busybox ] && /bin/busybox --list >/dev/null 2>&1 && ! ldd /bin/busybox >/dev/null 2>&1 \
  || missing+=(busybox-static)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
# The MCP client test (runtime/mcp) uses the Python MCP SDK under the python3 on PATH (which may
# be another interpreter than /usr/bin/python3): give that one pip if needed, then `mcp`.
python3 -c 'import mcp' 2>/dev/null || { python3 -m pip --version >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip; }; python3 -m pip install --quiet mcp || python3 -m pip install --quiet --break-system-packages mcp; }

# The Docker daemon: started here when it is not running, stopped at the end if we started it.
started_dockerd=
stop_dockerd() {
  if [ -n "$started_dockerd" ]; then
    kill -TERM "$started_dockerd" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$started_dockerd" 2>/dev/null || break; sleep 1; done
  fi
}
trap stop_dockerd EXIT
if ! docker info >/dev/null 2>&1; then
  dockerd >/tmp/taskbox-ci-dockerd.log 2>&1 &
  started_dockerd=$!
  for i in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$started_dockerd" 2>/dev/null || { cat /tmp/taskbox-ci-dockerd.log >&2; echo "dockerd exited" >&2; exit 1; }
    [ "$i" = 60 ] && { tail -20 /tmp/taskbox-ci-dockerd.log >&2; echo "dockerd did not come up in 60 s" >&2; exit 1; }
    sleep 1
  done
fi
echo "== docker $(docker version --format '{{.Server.Version}}')"

echo "== kernel $(uname -r); cgroups: $(stat -fc %T /sys/fs/cgroup)"
cargo --version
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings

scripts/test.sh
