#!/usr/bin/env bash
# CI entry: provision what the tests need on a fresh Debian machine, check formatting and lints,
# then run exactly the README's test command (scripts/test.sh) with every skip made a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export TASKBOX_REQUIRE_ALL=1
export CARGO_TERM_COLOR=never

# System packages the suites use: python3 (escape probes), util-linux (unshare, mount), iproute2.
missing=()
[ -x /usr/bin/python3 ] || missing+=(python3)
command -v unshare >/dev/null || missing+=(util-linux)
command -v runuser >/dev/null || missing+=(util-linux)
command -v useradd >/dev/null || missing+=(passwd)
# The image suites: the busybox image copies the static busybox; Debian bases need mmdebstrap.
[ -x /bin/busybox ] || missing+=(busybox-static)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
# The MCP client test (runtime/mcp) uses the Python MCP SDK under the python3 on PATH (which may
# be another interpreter than /usr/bin/python3): give that one pip if needed, then `mcp`.
python3 -c 'import mcp' 2>/dev/null || { python3 -m pip --version >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip; }; python3 -m pip install --quiet mcp || python3 -m pip install --quiet --break-system-packages mcp; }

echo "== kernel $(uname -r); cgroups: $(stat -fc %T /sys/fs/cgroup)"
cargo --version
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings

scripts/test.sh
