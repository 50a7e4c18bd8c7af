#!/usr/bin/env bash
# Installs the tools the findings suite (tests/tests/findings.rs) runs in its sandboxes, on a
# Debian 12 machine, where a host-view sandbox sees them: system packages under /usr, and PyPI and
# npm packages under /opt/taskbox-findings-tools (a host-view sandbox hides the home directories
# but for the policy's toolchain directories, and keeps /tmp and /var/tmp private, so neither a
# pip --user nor a global npm in root's home would be seen). Idempotent: a second run only checks
# and prints the versions.
#
#   scripts/findings-tools.sh          # TASKBOX_FINDINGS_TOOLS=DIR installs elsewhere
#
# cargo and rustc come from rustup in the home directory; the default policy shows ~/.cargo and
# ~/.rustup read-only inside a sandbox, so the suite runs the host's own.
set -euo pipefail

tools=${TASKBOX_FINDINGS_TOOLS:-/opt/taskbox-findings-tools}
# The versions the suite's expectations were written against: their output formats.
py_spec=("ruff>=0.6,<1" "mypy>=1.10,<2")
npm_spec=("jest@^29.7.0" "vitest@^3.2.0" "typescript@~5.6.0" "eslint@^9.10.0")

apt_missing=()
command -v go >/dev/null || apt_missing+=(golang-go)
command -v gcc >/dev/null || apt_missing+=(gcc libc6-dev)
/usr/bin/python3 -c 'import pytest' 2>/dev/null || apt_missing+=(python3-pytest)
/usr/bin/python3 -c 'import ensurepip, venv' 2>/dev/null || apt_missing+=(python3-venv)
command -v node >/dev/null || apt_missing+=(nodejs)
command -v npm >/dev/null || apt_missing+=(npm)
if [ ${#apt_missing[@]} -gt 0 ]; then
  echo "== findings tools: apt-get install ${apt_missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_missing[@]}" >/dev/null
fi

mkdir -p "$tools"
# PyPI: ruff and mypy in a venv of the system interpreter (which the sandbox sees).
py="$tools/py"
if [ "$(cat "$py/.spec" 2>/dev/null)" != "${py_spec[*]}" ] || ! "$py/bin/ruff" --version >/dev/null 2>&1 \
   || ! "$py/bin/mypy" --version >/dev/null 2>&1; then
  echo "== findings tools: pip install ${py_spec[*]} into $py"
  rm -rf "$py"
  /usr/bin/python3 -m venv "$py"
  "$py/bin/python" -m pip install --quiet --disable-pip-version-check "${py_spec[@]}"
  echo "${py_spec[*]}" > "$py/.spec"
fi

# npm: jest, vitest, typescript and eslint in one prefix; a fixture links its node_modules.
node="$tools/node"
if [ "$(cat "$node/.spec" 2>/dev/null)" != "${npm_spec[*]}" ] \
   || ! [ -x "$node/node_modules/.bin/jest" ] || ! [ -x "$node/node_modules/.bin/vitest" ] \
   || ! [ -x "$node/node_modules/.bin/tsc" ] || ! [ -x "$node/node_modules/.bin/eslint" ]; then
  echo "== findings tools: npm install ${npm_spec[*]} into $node"
  rm -rf "$node"
  mkdir -p "$node"
  echo '{"name": "taskbox-findings-tools", "private": true}' > "$node/package.json"
  (cd "$node" && npm install --silent --no-audit --no-fund --no-update-notifier "${npm_spec[@]}")
  echo "${npm_spec[*]}" > "$node/.spec"
fi
chmod -R a+rX "$tools"

bin="$node/node_modules/.bin"
echo "== findings tools in $tools:" \
  "go $(go env GOVERSION);" \
  "gcc $(gcc -dumpfullversion);" \
  "pytest $(/usr/bin/python3 -c 'import pytest; print(pytest.__version__)');" \
  "node $(node --version);" \
  "$("$py/bin/ruff" --version);" \
  "$("$py/bin/mypy" --version | cut -d' ' -f1-2);" \
  "jest $("$bin/jest" --version);" \
  "vitest $("$bin/vitest" --version | awk '{print $1}' | sed 's,^vitest/,,');" \
  "tsc $("$bin/tsc" --version | awk '{print $2}');" \
  "eslint $("$bin/eslint" --version)"
