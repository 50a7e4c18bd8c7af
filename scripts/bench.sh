#!/usr/bin/env bash
# Side-by-side benchmarks of taskbox; method, results and findings in BENCHMARKS.md.
#
#   scripts/bench.sh [all|startup|diff|memory|profile|api|egress|egress-tls|docker|replay|house|sdk|findings|peers|queue]...
#                                                                          (no argument: all)
#
#   startup  `taskbox run -- true` against `bwrap --unshare-all --ro-bind / / --dev /dev --proc /proc
#            true` with hyperfine; reports mean ± stddev and the ratio taskbox/bwrap (target <= 2x).
#   diff     `taskbox run --diff` after a one-file change in a 100,000-file git workspace against
#            `git status --porcelain` on the same tree; ratio git/taskbox (target >= 10x).
#   memory   peak RSS (`/usr/bin/time -v`) and throughput of `taskbox run` (and `--json`) while the
#            command writes 1 GiB to stdout (target < 64 MiB).
#   profile  where taskbox's time goes, mean per run of `run -- true` (perf, system-wide): off-CPU
#            time of its processes by kernel wait site (sched:sched_switch with call graphs) and
#            CPU time by syscall (cpu-clock); with `diff`, the off-CPU time of `run --diff` too.
#   api      long-lived sandboxes through the narrow API, measured by the bench client
#            `taskbox-bench` (crate bench/) against `taskbox serve` on a Unix socket: the round trip
#            of `exec /bin/true` (p50 < 5 ms) beside a one-shot `taskbox run -- true` (and `docker
#            exec CONTAINER true` when `docker info` works); `diff` after one change in the
#            100,000-file workspace (p50 < 10 ms) beside `git status --porcelain`; checkpoint and
#            restore with 10 changed files (p50 < 20 ms each); the supervisor's VmRSS with 64
#            idle sandboxes (< 100 MiB). Each also through the library in the client's process
#            (with and without the trace recorder the supervisor adds, and with its state on
#            tmpfs), to attribute the time.
#   docker   the Docker backend (as root, with a running dockerd), measured by `taskbox-bench docker`
#            in one run: create-to-first-exec of a sandbox from the warm pool against a cold
#            `docker run --rm IMAGE true` (target: pool >= 5x faster), and the `exec true` round
#            trip through the backend against `docker exec CONTAINER true` (target: no slower);
#            p50/p99 of each. The image is a busybox root file system imported into the daemon.
#   egress   the egress path of a sandbox (network mode "proxy"), measured by `taskbox-bench egress`:
#            curl downloading BENCH_EGRESS_BYTES (1 GiB) from a local server on the host's
#            127.0.0.1, inside a long-lived sandbox through its listener and the proxy (HTTP
#            forwarding and CONNECT) against curl directly on the host (target >= 0.8x), and the
#            latency a new connection through CONNECT adds (p50 < 1 ms); with the CPU seconds per
#            GiB of the server and proxy together and of the proxy's threads alone. Then
#            `taskbox-bench egress-hop`: one relay hop in one process, direct against the proxy's
#            splice relay and against an in-kernel sockmap redirect, and how much each lets queue
#            for a client that reads nothing (why the proxy does not redirect in the kernel).
#   egress-tls  what an inspected host (docs/secrets.md) adds to an HTTPS request, measured by
#            `taskbox-bench egress-tls` in one process on loopback: an HTTPS server whose
#            certificate a CA made at run time signs, the egress proxy letting two names through
#            (one a plain tunnel, the other inspected: a secret bound to it, so the proxy
#            terminates TLS with the sandbox's CA, checks the server's certificate, presents the
#            secret and re-encrypts), and a client; the two interleaved request by request (the
#            order reversed every other round), BENCH_TLS_ROUNDS (10) rounds of
#            BENCH_TLS_REQUESTS (200) requests per series: a new connection per request (CONNECT,
#            a full handshake, GET, close), and requests on a kept-alive connection. p50 and p99
#            of each, and what inspection adds (target: < 2 ms at p50). Part of `all`.
#   replay   replay overhead beyond executing the operations themselves: `taskbox-bench replay`
#            records a 1,000-operation trace (execs of /bin/true, writes and reads) on the native
#            backend, then runs `taskbox replay TRACE --json` BENCH_REPLAY_ROUNDS times; the
#            engine's time beyond the backend's calls (target < 5%), and the whole process's
#            (start, trace parsing, clean checkout of the workspace, report).
#   house    the old build against the new, side by side in one run: release builds of
#            BENCH_OLD_REV (default 31408a0, exported with git archive) and of the working tree (or
#            BENCH_REV), each with its own state directory, measured in BENCH_HOUSE_ROUNDS rounds
#            whose order alternates, so noise lands on both: `taskbox run -- true` (hyperfine:
#            wall and user+sys); through a supervisor of each build, both running, by one bench
#            client (the new tree's) over HTTP on their Unix sockets, one request to each in turn:
#            `exec /bin/true` round trips (p50, p99), `diff` after one change in the 100,000-file
#            workspace, checkpoint and restore with 10 changed files (and each supervisor's CPU
#            over each figure, as context); the VmRSS of a fresh supervisor of each with
#            BENCH_API_IDLE (64) idle sandboxes. Reports old, new, new/old, the range of new/old
#            over the rounds (the run-to-run spread), and "no slower" when new/old is at most 1
#            or some round had new at or below old. Not part of `all` (it builds a second revision).
#   sdk      `exec ["true"]` through the Python SDK (python/src, its sync client `Sandbox.exec` and
#            its async one, over the supervisor's Unix socket) against inspect-ai's `local` sandbox
#            (`LocalSandboxEnvironment.exec`, a plain subprocess), BENCH_SDK_EXECS (200)
#            sequential calls per side in each of BENCH_SDK_ROUNDS (5) rounds whose order
#            alternates, in one Python process (scripts/bench_sdk.py); p50/p99 of each side and
#            the ratio SDK/local (target: <= 1, no slower than local); then BENCH_SDK_CREATES (40)
#            sandbox create + destroy through the SDK (p50/p99). Needs inspect-ai and pydantic
#            under python3. Not part of `all`.
#   findings what reading findings costs and what it saves the model. Cost: a 100 MB test log
#            (BENCH_FINDINGS_MB) with one failing test in its middle, written by a generator
#            (scripts/findings_log.py) and by `cat`, and a 100 MB `go test -v` log (every line
#            holding an anchor; `findings_log.py --format go`) by `cat` and by its generator,
#            through two supervisors of this build, one started with TASKBOX_FINDINGS=off, in
#            BENCH_FINDINGS_ROUNDS (101) alternating rounds: the exec's time through the API with
#            findings over without (target: under 1.05; the ratio of the medians, and the median
#            of the rounds' ratios beside it). Text: the fixture projects of
#            tests/fixtures/findings and a 1 MB log, each result rendered as the model reads it
#            (the agent's and the MCP server's tool result, the agent's 8 KiB output limit) with
#            its findings first and as head and tail alone: bytes, and whether the failing
#            test's name and location are in it. Not part of `all`.
#   queue    the task queue (NATS JetStream; Debian's nats-server, started here on loopback):
#            the agent's sample task (three scripted turns against a model server in the bench
#            client) submitted to a warm `taskbox worker` against the same task run directly
#            (`taskbox agent run`), BENCH_QUEUE_ROUNDS (20) alternating rounds: from the submit
#            (or the command's start) to the start of the task's sandbox, and to the task's end,
#            p50/p99; then BENCH_QUEUE_TASKS (30) tasks submitted at once to 1, 2 and 3 workers:
#            tasks per second. Not part of `all`.
#   fork     the fleet figures of issue 19, by `taskbox-bench fork|density|rate` against a
#            supervisor of this build (and through the library in the client's process): fork 1 -> 16
#            of a sandbox with 10 changed files in the 100,000-file workspace, timed until all 16
#            have answered an `exec /bin/true` (target < 50 ms on native), with the warm pool of
#            forks (BENCH_FORK_POOL, 16) and without it (a second supervisor, and a second library
#            backend), interleaved round by round, with each round's ratio; density: live idle
#            sandboxes (one exec each) created until a create fails, BENCH_DENSITY_MAX (768) or the
#            host's MemAvailable falls under BENCH_DENSITY_FLOOR_MIB (4096), with host memory per
#            sandbox and the supervisor's RSS (target >= 512); sustained create + one exec +
#            destroy with 8 clients for BENCH_RATE_SECS (20) (target >= 100 per second on native).
#            Not part of `all`.
#   all      startup profile diff memory api docker egress egress-tls replay (the profile is skipped when
#            perf is not usable, docker when no daemon answers).
#
# Each hyperfine figure is measured in rounds (BENCH_ROUNDS x BENCH_RUNS runs per command, with
# the commands of a figure alternating between rounds), so a burst of noise on a shared machine
# lands on both sides of a ratio. Ratios are the ones to compare across machines.
#   peers    what agents run, under taskbox and the peers from npm (`@openai/codex`: `codex sandbox --
#            CMD`; `@anthropic-ai/sandbox-runtime`: `srt CMD`), installed in BENCH_PEERS_DIR when
#            missing, interleaved round by round (scripts/bench_peers.py, BENCH_PEERS_ROUNDS (20)
#            rounds): `true` against bwrap, `python3 -c 'import json'` and `git status` in a
#            20,000-file repository against the same command bare; `git status` and `true` as an
#            exec in a live sandbox (over the supervisor's Unix socket) against bare. Medians,
#            ratios to the baseline, targets of issue 17. Not part of `all`.
#
# Environment:
#   BENCH_TARGET_DIR  cargo target dir for the release build (default: target/bench, separate from
#                     the usual target/ so a benchmark build never waits on a development build)
#   BENCH_NO_BUILD=1  use the binaries already in $BENCH_TARGET_DIR/release
#   BENCH_REV=COMMIT  benchmark that commit (git archive + build) instead of the working tree
#   TASKBOX_BIN       benchmark this taskbox binary (taskbox-init beside it); skips the build
#   BENCH_ROUNDS      hyperfine rounds per figure (default 3)
#   BENCH_RUNS        runs per command per round (default 15; rounds x runs must be >= 30)
#   BENCH_FILES       files in the diff workspace (default 100000, 100 per directory)
#   BENCH_MEM_RUNS    runs per memory variant (default 3)
#   BENCH_PROFILE_RUNS  runs recorded by the profile (default 20)
#   BENCH_API_ROUNDS  rounds of the api figures (default 4)
#   BENCH_API_RUNS    exec round trips measured per series (default 2000, at least 1000)
#   BENCH_API_DIFF_RUNS  diffs measured per series, and git status runs (default 60, at least 50)
#   BENCH_API_CYCLES  checkpoint/change/restore cycles per series (default 40, at least 30)
#   BENCH_API_IDLE    idle sandboxes for the memory figure (default 64)
#   BENCH_EGRESS_BYTES   bytes per download of the egress figure (default 1073741824)
#   BENCH_EGRESS_ROUNDS  rounds of the egress figure (default 5)
#   BENCH_EGRESS_CONNS   new connections timed per side and round (default 500)
#   BENCH_TLS_ROUNDS     egress-tls: rounds (default 10)
#   BENCH_TLS_REQUESTS   egress-tls: measured requests per series per round (default 200)
#   BENCH_DOCKER_IMAGE  image of the container for `docker exec` (default debian:stable-slim;
#                     only used when `docker info` works)
#   BENCH_DOCKER_CREATES  measured pool creates and cold docker runs (default 40)
#   BENCH_DOCKER_EXECS    measured exec round trips of the backend (default 400; docker exec a quarter)
#   BENCH_REPLAY_OPS     operations in the replayed trace (default 1000)
#   BENCH_REPLAY_ROUNDS  replays measured (default 5)
#   BENCH_OLD_REV     house: the old revision (default 31408a0); its source and binaries are kept
#                     under $BENCH_TARGET_DIR/house/COMMIT, so a second run does not rebuild it
#   BENCH_OLD_BIN     house: use this old taskbox binary (taskbox-init beside it) instead
#   BENCH_HOUSE_ROUNDS   house: rounds of each timed figure (default 10, at least 3)
#   BENCH_HOUSE_RUNS     house: `run -- true` runs per build per round (default 30)
#   BENCH_HOUSE_EXECS    house: exec round trips per build per round (default 400)
#   BENCH_HOUSE_DIFFS    house: diffs per build per round (default 40)
#   BENCH_HOUSE_CYCLES   house: checkpoint/change/restore cycles per build per round (default 10)
#   BENCH_HOUSE_IDLE_ROUNDS  house: fresh supervisors per build for the memory figure (default 4)
#   BENCH_SDK_ROUNDS  sdk: rounds (default 5)
#   BENCH_SDK_EXECS   sdk: measured execs per side per round (default 200)
#   BENCH_SDK_CREATES sdk: measured sandbox create + destroy (default 40)
#   BENCH_PEERS_DIR   peers: where the npm peers are installed (default ~/.cache/taskbox-bench/peers)
#   BENCH_PEERS_ROUNDS  peers: measured rounds (default 20)
#   BENCH_FORK_RUNS   fork: measured forks 1 -> 16 per series (default 20)
#   BENCH_FORK_POOL   fork: the warm pool of forks per origin of the "pool" series (default 16;
#                     the "cold" series has none)
#   BENCH_RATE_SECS   fork: seconds of the sustained creation rate per series (default 20)
#   BENCH_DENSITY_MAX fork: the most sandboxes the density figure makes (default 768)
#   BENCH_DENSITY_FLOOR_MIB  fork: the density figure stops before the host's MemAvailable falls
#                     under this (default 4096: the machine is shared)
#   BENCH_KEEP=1      keep the scratch directory (hyperfine JSON, perf data, workspaces)
#   BENCH_OUT=FILE    also write the results table (markdown) to FILE
#   TMPDIR            where the scratch directory goes (default /var/tmp); the state directory and
#                     the workspaces live there, on the same filesystem
#
# Run it as root (what the figures in BENCHMARKS.md were measured as): missing tools are installed
# with apt-get (hyperfine, bubblewrap, time; linux-perf for the profile). Also needs cargo, git and
# python3.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }

# ---- arguments -------------------------------------------------------------------------------
want_startup=0 want_diff=0 want_memory=0 want_profile=0 want_api=0 want_docker=0 want_egress=0 want_replay=0
want_egress_tls=0 want_house=0 want_sdk=0 want_findings=0 want_peers=0 want_queue=0 want_fork=0
[ $# -eq 0 ] && set -- all
for arg in "$@"; do
  case "$arg" in
    all) want_startup=1 want_profile=1 want_diff=1 want_memory=1 want_api=1 want_docker=1 want_egress=1 want_egress_tls=1 want_replay=1 ;;
    startup) want_startup=1 ;;
    diff) want_diff=1 ;;
    memory) want_memory=1 ;;
    profile) want_profile=1 ;;
    api) want_api=1 ;;
    docker) want_docker=1 ;;
    egress) want_egress=1 ;;
    egress-tls) want_egress_tls=1 ;;
    replay) want_replay=1 ;;
    house) want_house=1 ;;
    sdk) want_sdk=1 ;;
    findings) want_findings=1 ;;
    peers) want_peers=1 ;;
    queue) want_queue=1 ;;
    fork) want_fork=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "bench.sh: unknown benchmark '$arg'" >&2; usage >&2; exit 2 ;;
  esac
done

ROUNDS=${BENCH_ROUNDS:-3}
RUNS=${BENCH_RUNS:-15}
FILES=${BENCH_FILES:-100000}
MEM_RUNS=${BENCH_MEM_RUNS:-3}
PROFILE_RUNS=${BENCH_PROFILE_RUNS:-20}
API_ROUNDS=${BENCH_API_ROUNDS:-4}
API_RUNS=${BENCH_API_RUNS:-2000}
API_DIFF_RUNS=${BENCH_API_DIFF_RUNS:-60}
API_CYCLES=${BENCH_API_CYCLES:-40}
API_IDLE=${BENCH_API_IDLE:-64}
EGRESS_BYTES=${BENCH_EGRESS_BYTES:-1073741824}
EGRESS_ROUNDS=${BENCH_EGRESS_ROUNDS:-5}
EGRESS_CONNS=${BENCH_EGRESS_CONNS:-500}
if [ $((ROUNDS * RUNS)) -lt 30 ]; then
  echo "bench.sh: BENCH_ROUNDS x BENCH_RUNS must be at least 30" >&2
  exit 2
fi
HOUSE_ROUNDS=${BENCH_HOUSE_ROUNDS:-10}
HOUSE_RUNS=${BENCH_HOUSE_RUNS:-30}
HOUSE_EXECS=${BENCH_HOUSE_EXECS:-400}
HOUSE_DIFFS=${BENCH_HOUSE_DIFFS:-40}
HOUSE_CYCLES=${BENCH_HOUSE_CYCLES:-10}
HOUSE_IDLE_ROUNDS=${BENCH_HOUSE_IDLE_ROUNDS:-4}
for v in HOUSE_ROUNDS HOUSE_RUNS HOUSE_EXECS HOUSE_DIFFS HOUSE_CYCLES HOUSE_IDLE_ROUNDS; do
  case "${!v}" in
    '' | *[!0-9]*) echo "bench.sh: BENCH_$v must be a whole number, not '${!v}'" >&2; exit 2 ;;
  esac
done
if [ "$HOUSE_ROUNDS" -lt 3 ] || [ "$HOUSE_IDLE_ROUNDS" -lt 1 ] || [ "$HOUSE_RUNS" -lt 3 ] \
  || [ "$HOUSE_EXECS" -lt 10 ] || [ "$HOUSE_DIFFS" -lt 3 ] || [ "$HOUSE_CYCLES" -lt 2 ]; then
  echo "bench.sh: BENCH_HOUSE_ROUNDS >= 3 (a spread needs rounds), BENCH_HOUSE_IDLE_ROUNDS >= 1," \
    "BENCH_HOUSE_RUNS >= 3, BENCH_HOUSE_EXECS >= 10, BENCH_HOUSE_DIFFS >= 3, BENCH_HOUSE_CYCLES >= 2" >&2
  exit 2
fi
if [ "$API_RUNS" -lt 1000 ] || [ "$API_DIFF_RUNS" -lt 50 ] || [ "$API_CYCLES" -lt 30 ]; then
  echo "bench.sh: BENCH_API_RUNS >= 1000, BENCH_API_DIFF_RUNS >= 50 and BENCH_API_CYCLES >= 30" >&2
  exit 2
fi

START=$SECONDS
log() { printf '\n== %s  [+%ds]\n' "$*" $((SECONDS - START)) >&2; }
die() { echo "bench.sh: $*" >&2; exit 1; }

# ---- tools -----------------------------------------------------------------------------------
apt_install() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq "$@" >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "$@" >/dev/null 2>&1; }
}
need=()
command -v hyperfine >/dev/null || need+=(hyperfine)
command -v bwrap >/dev/null || need+=(bubblewrap)
[ -x /usr/bin/time ] || need+=(time)
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  apt_install "${need[@]}" || die "missing ${need[*]} (run as root to install them with apt-get)"
fi
for t in git python3 bc; do
  command -v "$t" >/dev/null || apt_install "$t" || die "$t not found"
done
[ -n "${TASKBOX_BIN:-}" ] || command -v cargo >/dev/null || die "cargo not found"

# ---- scratch space ---------------------------------------------------------------------------
SCRATCH=$(mktemp -d "${TMPDIR:-/var/tmp}/taskbox-bench.XXXXXX")
SERVE_PID= DOCKER_CID= HOUSE_PIDS=
cleanup() {
  local p
  for p in $SERVE_PID $HOUSE_PIDS; do
    kill -TERM "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  [ -z "$DOCKER_CID" ] || docker rm -f "$DOCKER_CID" >/dev/null 2>&1 || true
  if [ "${BENCH_KEEP:-0}" = 1 ]; then
    echo "bench.sh: kept $SCRATCH" >&2
  else
    rm -rf "$SCRATCH"
  fi
}
trap cleanup EXIT
export TASKBOX_STATE_DIR=$SCRATCH/state
mkdir -p "$TASKBOX_STATE_DIR" "$SCRATCH/ws"
echo "hello" > "$SCRATCH/ws/README"
ROWS=$SCRATCH/rows.md
: > "$ROWS"
SHM_STATE=
if [ "$(stat -f -c %T /dev/shm 2>/dev/null || true)" = tmpfs ]; then
  SHM_STATE=$(mktemp -d /dev/shm/taskbox-bench.XXXXXX)
  trap 'rm -rf "$SHM_STATE"; cleanup' EXIT
fi

# ---- binaries --------------------------------------------------------------------------------
# BENCH_REV: build that commit (exported with git archive, so uncommitted changes in the working
# tree do not leak in) instead of the working tree.
source_desc=
target_dir=${BENCH_TARGET_DIR:-target/bench}
# house: the old build first, in the same target dir (the two share their dependencies' builds),
# its binaries copied out before the new build replaces them in release/.
OLD_TASKBOX= old_desc=
if [ $want_house = 1 ]; then
  if [ -n "${BENCH_OLD_BIN:-}" ]; then
    OLD_TASKBOX=$(readlink -f "$BENCH_OLD_BIN")
    old_desc="BENCH_OLD_BIN (built elsewhere)"
  else
    command -v cargo >/dev/null || die "cargo not found (needed to build BENCH_OLD_REV)"
    old_rev=${BENCH_OLD_REV:-31408a0}
    old_sha=$(git -C "$repo" rev-parse --verify -q "$old_rev^{commit}") \
      || die "BENCH_OLD_REV '$old_rev' is not a commit of this repository (a shallow clone? git fetch --unshallow)"
    mkdir -p "$target_dir"
    target_dir=$(cd "$target_dir" && pwd)
    # Kept across runs at a fixed path: cargo's fingerprints include the source's path, so a new
    # scratch path would rebuild every crate of the workspace each time.
    old_home=$target_dir/house/$old_sha
    if [ ! -f "$old_home/src.done" ]; then
      rm -rf "$old_home/src"
      mkdir -p "$old_home/src"
      git -C "$repo" archive "$old_sha" | tar -x -C "$old_home/src"
      touch "$old_home/src.done"
    fi
    if [ "${BENCH_NO_BUILD:-0}" = 1 ]; then
      # Building it now would replace the new binaries in release/ that BENCH_NO_BUILD means.
      [ -x "$old_home/bin/taskbox" ] || die "BENCH_NO_BUILD=1, but no old build at $old_home/bin (run once without it)"
    else
      log "building release binaries of the old revision ${old_sha:0:7} (CARGO_TARGET_DIR=$target_dir)"
      (cd "$old_home/src" && CARGO_TARGET_DIR=$target_dir cargo build --release -q -p taskbox -p taskbox-init)
      mkdir -p "$old_home/bin"
      cp "$target_dir/release/taskbox" "$target_dir/release/taskbox-init" "$old_home/bin/"
    fi
    OLD_TASKBOX=$old_home/bin/taskbox
    old_desc="${old_sha:0:7} (release build of that commit)"
  fi
  [ -x "$OLD_TASKBOX" ] || die "no old taskbox binary at $OLD_TASKBOX"
  [ -x "$(dirname "$OLD_TASKBOX")/taskbox-init" ] || die "no taskbox-init beside $OLD_TASKBOX"
fi
if [ -n "${TASKBOX_BIN:-}" ]; then
  TASKBOX=$(readlink -f "$TASKBOX_BIN")
  source_desc="TASKBOX_BIN (built elsewhere)"
else
  mkdir -p "$target_dir"
  target_dir=$(cd "$target_dir" && pwd)
  src=$repo
  if [ -n "${BENCH_REV:-}" ]; then
    src=$SCRATCH/src
    mkdir -p "$src"
    git -C "$repo" archive "$BENCH_REV" | tar -x -C "$src"
    source_desc="$(git -C "$repo" rev-parse --short "$BENCH_REV") (release build of that commit)"
  else
    source_desc="$(git -C "$repo" describe --always --dirty 2>/dev/null || echo '?') (release build of the working tree)"
  fi
  if [ "${BENCH_NO_BUILD:-0}" != 1 ]; then
    log "building release binaries (CARGO_TARGET_DIR=$target_dir)"
    (cd "$src" && CARGO_TARGET_DIR=$target_dir cargo build --release -q -p taskbox -p taskbox-init)
    if [ $want_api = 1 ] || [ $want_docker = 1 ] || [ $want_egress = 1 ] || [ $want_replay = 1 ] \
      || [ $want_egress_tls = 1 ] || [ $want_house = 1 ] || [ $want_peers = 1 ] || [ $want_findings = 1 ] \
      || [ $want_queue = 1 ] || [ $want_fork = 1 ]; then
      # A separate build, so the client's dependencies cannot change the runtime's features.
      [ -f "$src/bench/Cargo.toml" ] || die "the api benchmark needs the bench/ crate, which this source lacks"
      (cd "$src" && CARGO_TARGET_DIR=$target_dir cargo build --release -q -p taskbox-bench)
    fi
  fi
  TASKBOX=$target_dir/release/taskbox
fi
[ -x "$TASKBOX" ] || die "no taskbox binary at $TASKBOX"
[ -x "$(dirname "$TASKBOX")/taskbox-init" ] || die "no taskbox-init beside $TASKBOX"
# The api benchmark's client (with TASKBOX_BIN: beside it, e.g. cargo build --release -p taskbox-bench).
BENCH_CLIENT=$(dirname "$TASKBOX")/taskbox-bench
if { [ $want_api = 1 ] || [ $want_docker = 1 ] || [ $want_egress = 1 ] || [ $want_replay = 1 ] \
  || [ $want_egress_tls = 1 ] || [ $want_house = 1 ] || [ $want_peers = 1 ] || [ $want_fork = 1 ]; } && [ ! -x "$BENCH_CLIENT" ]; then
  die "no taskbox-bench beside $TASKBOX (cargo build --release -p taskbox-bench)"
fi

# The Python helpers: hyperfine aggregation, /usr/bin/time parsing, the off-CPU profile.
cat > "$SCRATCH/helpers.py" <<'PY'
import glob, json, os, re, statistics, sys, collections

def md_row(cells):
    return "| " + " | ".join(cells) + " |\n"

def hf(args):
    """hf ROWS LABEL SUBJECT BASE DIRECTION TARGET FILES...: aggregate hyperfine exports (rounds);
    DIRECTION 'sb' = ratio subject/base (target: at most TARGET), 'bs' = base/subject (at least)."""
    rows, label, subject, base, direction, target, *files = args
    times, cpu = collections.OrderedDict(), collections.defaultdict(list)
    for f in files:
        for r in json.load(open(f))["results"]:
            times.setdefault(r["command"], []).extend(r["times"])
            cpu[r["command"]].append((r["user"] + r["system"]) * 1000)
    st = {}
    for name, ts in times.items():
        ms = [t * 1000 for t in ts]
        st[name] = (statistics.mean(ms), statistics.stdev(ms), statistics.median(ms), min(ms), len(ms))
    print(f"  {'command':<30} {'mean ± stddev':>20} {'median':>9} {'min':>8} {'user+sys':>9} {'runs':>5}")
    for name, (m, s, med, lo, n) in st.items():
        c = statistics.mean(cpu[name])
        print(f"  {name:<30} {m:9.1f} ± {s:6.1f} ms {med:7.1f} ms {lo:6.1f} ms {c:6.1f} ms {n:5d}")
    (sm, ss, smed, _, _), (bm, bs, bmed, _, _) = st[subject], st[base]
    if direction == "sb":
        r, rmed, ok = sm / bm, smed / bmed, sm / bm <= float(target)
        rtext = f"{subject}/{base}"
        ttext = f"<= {target}x"
    else:
        r, rmed, ok = bm / sm, bmed / smed, bm / sm >= float(target)
        rtext = f"{base}/{subject}"
        ttext = f">= {target}x"
    err = r * ((ss / sm) ** 2 + (bs / bm) ** 2) ** 0.5
    print(f"  ratio {rtext}: {r:.2f}x ± {err:.2f} (of means), {rmed:.2f}x (of medians); "
          f"target {ttext}: {'met' if ok else 'NOT met'}")
    with open(rows, "a") as out:
        out.write(md_row([label, f"{sm:.1f} ± {ss:.1f} ms (median {smed:.1f})",
                             f"{base}: {bm:.1f} ± {bs:.1f} ms (median {bmed:.1f})",
                             f"{r:.2f}x ± {err:.2f} (medians {rmed:.2f}x)", ttext,
                             "yes" if ok else "**no**"]))
    # The other commands: a taskbox variant against the base ('sb'), or a baseline variant
    # against taskbox ('bs').
    for name, (m, s, med, _, _) in st.items():
        if name not in (subject, base):
            rr, what = (m / bm, f"{name}/{base}") if direction == "sb" else (m / sm, f"{name}/{subject}")
            cols = ([f"{m:.1f} ± {s:.1f} ms (median {med:.1f})", ""] if direction == "sb"
                    else ["", f"{name}: {m:.1f} ± {s:.1f} ms (median {med:.1f})"])
            with open(rows, "a") as out:
                out.write(md_row([f"{label}: {name}", *cols, f"{what}: {rr:.2f}x", "", ""]))

def timev(args):
    """timev FILE: prints 'seconds max_rss_kib exit_status' from `/usr/bin/time -v` output."""
    text = open(args[0]).read()
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    el = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text).group(1)
    secs = 0.0
    for part in el.split(":"):
        secs = secs * 60 + float(part)
    code = int(re.search(r"Exit status: (\d+)", text).group(1))
    print(f"{secs:.3f} {rss} {code}")

def stats(args):
    """stats V...: 'median max' of numbers."""
    v = [float(x) for x in args]
    print(f"{statistics.median(v):.3f} {max(v):.3f}")

def jsonfield(args):
    """jsonfield FILE a.b.c: one field of a JSON document."""
    v = json.load(open(args[0]))
    for k in args[1].split("."):
        v = v[k]
    print(v)

SKIP = re.compile(r"^(__schedule|schedule|schedule_timeout|schedule_preempt_disabled|io_schedule|"
                  r"io_schedule_timeout|bit_wait_io|__wait_on_bit|out_of_line_wait_on_bit|"
                  r"wait_for_completion.*|__wait_for_common|do_wait_for_common|preempt_schedule.*|"
                  r"_*cond_resched|schedule_hrtimeout_range.*|do_nanosleep|rwsem_down_.*|"
                  r"percpu_down_write|__percpu_down_read|percpu_rwsem_wait|__mutex_lock.*|mutex_lock.*|"
                  r"synchronize_rcu.*|rcu_sync_enter|wait_rcu_gp|__wait_rcu_gp|exit_to_user_mode_loop|"
                  r"irqentry_exit_to_user_mode|do_syscall_64|entry_SYSCALL_64_after_hwframe|asm_.*|"
                  r"x64_sys_call|__x64_sys_.*|\[unknown\]|folio_wait_bit.*|__folio_lock.*)$")
HEAD = re.compile(r"^\s*(.+?)\s+(\d+)/(\d+)\s+(\d+\.\d+):\s+(\d+)\s+(\S+):\s*(.*)$")
SWITCH = re.compile(r"prev_comm=(.*?) prev_pid=(\d+) prev_prio=\d+ prev_state=(\S+) ==> "
                    r"next_comm=(.*?) next_pid=(\d+)")
FORK = re.compile(r"pid=(\d+) child_comm=.*? child_pid=(\d+)")

def perf_events(root):
    """Events of `perf script -F comm,pid,tid,time,event,period,trace,ip,sym` on stdin, each with
    a flag saying whether its task descends from pid `root` (followed through fork events), so
    that processes of the same name elsewhere on the machine are not counted. The thread ids in
    $PERF_SEED count too (and what they fork): a server started before the recording."""
    ours, ev = set(int(t) for t in os.environ.get("PERF_SEED", "").split()), None
    def done(e):
        if e is None:
            return None
        if "sched_process_fork" in e["event"]:
            m = FORK.search(e["trace"])
            if m and (int(m.group(1)) in ours or int(m.group(1)) == root):
                ours.add(int(m.group(2)))
        e["ours"] = e["tid"] in ours
        return e
    for line in sys.stdin:
        m = HEAD.match(line)
        if m:
            if done(ev):
                yield ev
            ev = dict(comm=m.group(1), tid=int(m.group(3)), t=float(m.group(4)),
                      period=int(m.group(5)), event=m.group(6), trace=m.group(7), stack=[])
            ev["ours_set"] = ours
        elif ev is not None and line.strip():
            parts = line.split(None, 1)
            sym = parts[1].strip().split("+")[0] if len(parts) > 1 else "?"
            ev["stack"].append((parts[0].startswith("ffffffff"), sym))
    if done(ev):
        yield ev

def offcpu(args):
    """offcpu RUNS ROOT_PID: the time the benchmarked processes spent off-CPU, grouped by the
    kernel frames they blocked in, per run (from sched:sched_switch with call graphs)."""
    runs, root = int(args[0]), int(args[1])
    away, total, count = {}, collections.defaultdict(float), collections.Counter()
    for e in perf_events(root):
        if "sched_switch" not in e["event"]:
            continue
        m = SWITCH.search(e["trace"])
        prev, state, nxt = int(m.group(2)), m.group(3), int(m.group(5))
        if nxt in away:
            t0, key = away.pop(nxt)
            total[key] += e["t"] - t0
            count[key] += 1
        if prev in e["ours_set"]:
            if state.startswith("R"):
                why = "runnable, waiting for a CPU (preempted)"
            else:
                frames = [f for k, f in e["stack"] if k and not SKIP.match(f)]
                call = next((f for k, f in e["stack"] if f.startswith("__x64_sys_")), "")
                why = " < ".join(frames[:3]) + (f"  [{call[len('__x64_sys_'):]}]" if call else "")
                why = f"{state[0]} {why}"
            away[prev] = (e["t"], (m.group(1), why))
    print("  off-CPU ms/run  times/run  process        blocked in (innermost frames < callers  [syscall])")
    for key, v in sorted(total.items(), key=lambda kv: -kv[1])[:18]:
        print(f"  {v / runs * 1000:13.2f}  {count[key] / runs:9.1f}  {key[0]:<14} {key[1]}")
    print("  (a parent's poll/wait4 rows are time spent waiting for its child: they overlap the"
          " child's rows)")

def oncpu(args):
    """oncpu RUNS ROOT_PID: the CPU time of the benchmarked processes by outermost syscall (or page
    faults, or user space), per run (from cpu-clock samples with call graphs)."""
    runs, root = int(args[0]), int(args[1])
    total, per_comm = collections.defaultdict(int), collections.defaultdict(int)
    for e in perf_events(root):
        if not e["ours"] or not e["event"].startswith("cpu-clock"):
            continue
        frames, cat = e["stack"], None
        for i, (kern, f) in enumerate(frames):  # innermost first
            m = re.match(r"__(?:x64|do)_sys_(\w+)$", f)
            if m:
                cat = "syscall " + m.group(1)
            elif f == "asm_exc_page_fault":
                cat = "page faults"
            elif f == "entry_SYSCALL_64_after_hwframe" and cat is None:
                # the wrapper was inlined: name the call by its libc function
                outer = [g for k, g in frames[i + 1:] if not k and g != "[unknown]"]
                inner = [g for k, g in frames[:i] if k and g != "do_syscall_64"]
                name = outer[0] if outer and outer[0] != "syscall" else inner[-1] if inner else "?"
                cat = "syscall " + name
        if cat is None:
            kframes = [f for k, f in frames if k]
            if any(f.startswith("ret_from_fork") for f in kframes):
                cat = "new process start (ret_from_fork)"
            elif kframes:
                cat = "kernel, other: " + kframes[-1]
            else:
                cat = "user space"
        total[(e["comm"], cat)] += e["period"]
        per_comm[e["comm"]] += e["period"]
    print("  on-CPU ms/run by process: " + ", ".join(
        f"{c} {v / runs / 1e6:.2f}" for c, v in sorted(per_comm.items(), key=lambda kv: -kv[1])))
    print("  on-CPU ms/run  process        where (outermost syscall, page faults, or user space)")
    for key, v in sorted(total.items(), key=lambda kv: -kv[1])[:18]:
        print(f"  {v / runs / 1e6:13.2f}  {key[0]:<14} {key[1]}")

def api(args):
    """api ROWS DIR DOCKER_NOTE WORKLOAD_RSS_KIB WORKLOAD_REQUESTS FILES: the api figures from
    the JSON of taskbox-bench in DIR (api-exec.json, api-diff.json, api-checkpoint.json,
    api-idle.json); prints them and appends the results rows to ROWS."""
    rows, d, docker_note, wl_rss, wl_reqs, files = args
    figs = {}
    for f in ("exec", "diff", "checkpoint", "idle"):
        try:
            figs[f] = json.load(open(f"{d}/api-{f}.json"))
        except FileNotFoundError:
            pass
    def series(fig):
        return {s["name"]: s for s in figs[fig]["series"]}
    def pr(fig):
        print(f"  {fig}: {'series':<34} {'n':>5} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8} {'mean':>8}  (ms)")
        for s in figs[fig]["series"]:
            print(f"  {'':<{len(fig)}}  {s['name']:<34} {s['n']:5d} {s['p50_ms']:8.2f} {s['p90_ms']:8.2f}"
                  f" {s['p99_ms']:8.2f} {s['max_ms']:8.2f} {s['mean_ms']:8.2f}")
        conns = figs[fig].get("http_connections")
        if conns:
            print(f"  {'':<{len(fig)}}  HTTP connections opened: {conns} (1 = keep-alive held throughout)")
    def pp(s, p99=True):
        t = f"p50 {s['p50_ms']:.2f} ms"
        return t + (f", p99 {s['p99_ms']:.2f} ms" if p99 else "") + f" (n={s['n']})"
    def met(ok):
        return "yes" if ok else "**no**"
    out = []
    if "exec" in figs:
        pr("exec")
        s = series("exec")
        h = s["http"]
        base = [f"`taskbox run -- true` (one-shot): {pp(s['taskbox run -- true'])}"]
        ratio = [f"one-shot/exec p50 {s['taskbox run -- true']['p50_ms'] / h['p50_ms']:.1f}x"]
        if "docker exec" in s:
            base.append(f"`docker exec CONTAINER true`: {pp(s['docker exec'])}")
            ratio.append(f"docker exec/exec p50 {s['docker exec']['p50_ms'] / h['p50_ms']:.1f}x")
        else:
            base.append(f"`docker exec`: {docker_note}")
        out.append(md_row(["`exec` argv `/bin/true` in a live sandbox, HTTP on the Unix socket",
                           pp(h), "; ".join(base), "; ".join(ratio), "p50 < 5 ms",
                           met(h["p50_ms"] < 5)]))
        if "lib" in s:
            lib = [f"{n}: {pp(s[n])}" for n in ("lib", "lib+trace", "lib, state on tmpfs") if n in s]
            out.append(md_row(["same, through the library (diagnostic)", "; ".join(lib), "",
                               f"http/lib p50 {h['p50_ms'] / s['lib']['p50_ms']:.2f}x", "", ""]))
    if "diff" in figs:
        pr("diff")
        s = series("diff")
        h, g = s["http"], s["git status --porcelain"]
        out.append(md_row([f"`diff` after 1 change in {int(files):,} files, HTTP", pp(h),
                           f"`git status --porcelain`: {pp(g)}",
                           f"git/diff p50 {g['p50_ms'] / h['p50_ms']:.0f}x", "p50 < 10 ms",
                           met(h["p50_ms"] < 10)]))
        if "lib" in s:
            lib = [f"{n}: {pp(s[n])}" for n in ("lib", "lib+trace", "lib, state on tmpfs") if n in s]
            out.append(md_row(["same, through the library (diagnostic)", "; ".join(lib), "", "", "", ""]))
    if "checkpoint" in figs:
        pr("checkpoint")
        s = series("checkpoint")
        for op in ("checkpoint", "restore"):
            h = s[f"http {op}"]
            out.append(md_row([f"{op}, {int(files):,}-file workspace with 10 changed files, HTTP",
                               pp(h), "", "", "p50 < 20 ms", met(h["p50_ms"] < 20)]))
            lib = [f"{n}: {pp(s[f'{n} {op}'])}" for n in ("lib", "lib+trace", "lib, state on tmpfs") if f"{n} {op}" in s]
            if lib:
                out.append(md_row([f"{op}, through the library (diagnostic)", "; ".join(lib),
                                   "", "", "", ""]))
    if "idle" in figs:
        pr("idle")
        f = figs["idle"]
        n = f["count"]
        w, b, a = f["with_sandboxes"], f["before"], f["after_destroy"]
        helpers = {k["comm"]: k for k in w["descendants"]}
        print(f"  idle: supervisor VmRSS {b['rss_mib']:.1f} MiB with no sandbox, {w['rss_mib']:.1f} MiB with"
              f" {n} (PSS {w['pss_mib']:.1f}, {w['threads']} threads), {a['rss_mib']:.1f} MiB after destroying"
              f" them (VmHWM {a['hwm_mib']:.1f})")
        for k in w["descendants"]:
            print(f"  idle: descendants {k['comm']}: {k['count']} processes, RSS {k['rss_mib']:.1f} MiB"
                  f" ({k['rss_mib'] / n:.2f} per sandbox), PSS {k['pss_mib']:.1f} MiB"
                  f" ({k['pss_mib'] / n:.2f} per sandbox)")
        hl = helpers.get("taskbox-init")
        htext = (f"helpers: {hl['count']} `taskbox-init` processes, RSS {hl['rss_mib'] / n:.2f} MiB"
                 f" per sandbox (PSS {hl['pss_mib'] / n:.2f})" if hl else "helpers: none found")
        out.append(md_row([f"supervisor VmRSS with {n} idle sandboxes",
                           f"{w['rss_mib']:.1f} MiB ({b['rss_mib']:.1f} with none,"
                           f" {a['rss_mib']:.1f} after destroying them)",
                           htext, f"{(w['rss_mib'] - b['rss_mib']) / n * 1024:.0f} KiB per sandbox"
                           " in the supervisor", "< 100 MiB", met(w["rss_mib"] < 100)]))
        cs = {s["name"]: s for s in f["series"]}
        out.append(md_row([f"create / destroy, {n} sandboxes in a row (context)",
                           f"create {pp(cs['create'], False)}; destroy {pp(cs['destroy'], False)}",
                           "", "", "", ""]))
    if wl_rss:
        print(f"  supervisor VmRSS after the exec, diff and checkpoint figures ({wl_reqs} requests):"
              f" {int(wl_rss) / 1024:.1f} MiB")
        out.append(md_row([f"supervisor VmRSS after the figures above ({wl_reqs} requests; context)",
                           f"{int(wl_rss) / 1024:.1f} MiB", "", "", "", ""]))
    with open(rows, "a") as fh:
        fh.writelines(out)

def egress(args):
    """egress ROWS FILE: the egress figures from taskbox-bench egress's JSON."""
    rows, path = args
    f = json.load(open(path))
    out = []
    def met(ok):
        return "yes" if ok else "**no**"
    d = {r["name"]: r for r in f["download"]}
    direct = d["curl direct (host)"]
    for name, r in d.items():
        print(f"  egress: {name}: median {r['median_s']:.3f} s ({r['mib_per_s']:.0f} MiB/s), best"
              f" {r['best_s']:.3f} s" + (f", {r['vs_direct_median_of_rounds']:.2f}x of direct"
                                        if r["vs_direct_median_of_rounds"] is not None else "")
              + (f"; CPU s/GiB: server+proxy {r['server_proxy_cpu_s_per_gib']:.2f}, proxy"
                 f" {r['proxy_cpu_s_per_gib']:.2f}" if "proxy_cpu_s_per_gib" in r else ""))
    for name in ["curl in sandbox, HTTP forwarding", "curl in sandbox, CONNECT"]:
        r = d[name]
        ratio = r["vs_direct_median_of_rounds"]
        out.append(md_row([f"{r['gib']:g} GiB download, {name}",
                           f"{r['median_s']:.3f} s ({r['mib_per_s']:.0f} MiB/s)",
                           f"curl on the host: {direct['median_s']:.3f} s ({direct['mib_per_s']:.0f} MiB/s)",
                           f"{ratio:.2f}x", ">= 0.8x", met(ratio >= 0.8)]))
    lat = {s["name"]: s for s in f["latency"]}
    base, prox = lat["direct"], lat["sandbox, CONNECT"]
    added = prox["added_p50_ms"]
    print(f"  egress: new connection + small request: direct p50 {base['p50_ms']:.3f} ms (p99"
          f" {base['p99_ms']:.3f}); through the sandbox's proxy p50 {prox['p50_ms']:.3f} ms (p99"
          f" {prox['p99_ms']:.3f}); added {added:.3f} ms")
    out.append(md_row(["new connection + small request, through the sandbox's proxy (CONNECT)",
                       f"p50 {prox['p50_ms']:.3f} ms (p99 {prox['p99_ms']:.3f})",
                       f"direct on the host: p50 {base['p50_ms']:.3f} ms",
                       f"+{added:.3f} ms", "< 1 ms added", met(added < 1.0)]))
    with open(rows, "a") as fh:
        fh.writelines(out)

def egress_tls(args):
    """egress_tls ROWS FILE: an inspected host against a plain tunnel, from taskbox-bench egress-tls."""
    rows, path = args
    f = json.load(open(path))
    s = {r["name"]: r for r in f["series"]}
    out = []
    for kind, key in [("new connection", "new_connection"), ("kept-alive connection", "kept_alive")]:
        plain, insp, c = s[f"{kind}, plain tunnel"], s[f"{kind}, inspected"], f[key]
        spread = [b["p50_ms"] - a["p50_ms"] for a, b in zip(plain["rounds"], insp["rounds"])]
        print(f"  egress-tls: {kind}: plain tunnel p50 {plain['p50_ms']:.3f} ms (p99 {plain['p99_ms']:.3f}),"
              f" inspected p50 {insp['p50_ms']:.3f} ms (p99 {insp['p99_ms']:.3f}); added p50"
              f" {c['added_p50_ms']:+.3f} ms ({c['ratio_p50']:.2f}x), p99 {c['added_p99_ms']:+.3f} ms"
              f" ({c['ratio_p99']:.2f}x); per round added p50 {min(spread):+.3f} to {max(spread):+.3f} ms")
        target = "< 2 ms added at p50" if key == "new_connection" else "(context)"
        met = ("yes" if c["added_p50_ms"] < 2.0 else "**no**") if key == "new_connection" else ""
        out.append(md_row([f"HTTPS request through an inspected host (secret added), {kind}",
                           f"p50 {insp['p50_ms']:.3f} ms (p99 {insp['p99_ms']:.3f})",
                           f"plain tunnel: p50 {plain['p50_ms']:.3f} ms (p99 {plain['p99_ms']:.3f})",
                           f"{c['added_p50_ms']:+.3f} ms p50 ({c['ratio_p50']:.2f}x), {c['added_p99_ms']:+.3f} ms p99 ({c['ratio_p99']:.2f}x)",
                           target, met]))
    with open(rows, "a") as fh:
        fh.writelines(out)

def egress_hop(args):
    """egress_hop ROWS FILE: one relay hop, direct / splice relay / sockmap redirect."""
    rows, path = args
    f = json.load(open(path))
    out = []
    gib = f["bytes"] / (1 << 30)
    t = {r["mode"]: r for r in f["transfer"]}
    for mode, r in t.items():
        print(f"  egress-hop: {mode}: median {r['median_s']:.3f} s, {r['vs_direct_median_of_rounds']:.2f}x"
              f" of direct (rounds {r['vs_direct_min']:.2f}-{r['vs_direct_max']:.2f}x)")
    stall = {r["mode"]: r["pushed_bytes"] for r in f["stalled_client"]["runs"]}
    for mode, pushed in stall.items():
        print(f"  egress-hop: {mode}: {pushed / (1 << 20):.1f} MiB pushed towards a client that read"
              f" nothing for {f['stalled_client']['secs']:g} s")
    for mode, what in [("relay", "splice relay (the proxy's way)"), ("sockmap", "sk_msg sockmap redirect (not used)")]:
        if mode in t:
            r = t[mode]
            out.append(md_row([f"{gib:g} GiB over one relay hop, {what}; queued for a stalled client",
                               f"{r['median_s']:.3f} s; {stall.get(mode, 0) / (1 << 20):.1f} MiB queued",
                               f"one TCP hop: {t['direct']['median_s']:.3f} s",
                               f"{r['vs_direct_median_of_rounds']:.2f}x", "(informative)", ""]))
    with open(rows, "a") as fh:
        fh.writelines(out)

def treecpu(args):
    """treecpu PID: CPU ms of PID and its live descendants, each with its reaped children's
    (utime + stime + cutime + cstime from /proc/*/stat)."""
    root, tick, procs = int(args[0]), os.sysconf("SC_CLK_TCK"), {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                st = open(f"/proc/{p}/stat").read()
            except OSError:
                continue
            f = st[st.rindex(")") + 2:].split()  # fields from the state on: PPID is f[1]
            procs[int(p)] = (int(f[1]), sum(int(x) for x in f[11:15]))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += procs.get(pid, (0, 0))[1]
        todo.extend(c for c, (pp, _) in procs.items() if pp == pid)
    print(total * 1000 // tick)

def house(args):
    """house OUT DIR OLD NEW FILES: the table of the old build against the new from DIR's
    house-*.json (OLD and NEW name the builds in its header); prints the rounds, writes the
    markdown table to OUT. A figure's spread is the range of new/old over its rounds; the verdict
    is "no slower" when new/old is at most 1, or when some round had new at or below old (the
    difference is within the spread); otherwise every round had new above old."""
    out, d, old_name, new_name, files = args
    files = int(files)
    rows = []
    def judge(r, lo, good, bad):
        if r <= 1:
            return good
        return f"{good} (within the spread)" if lo <= 1 else f"**{bad}**"
    def row(label, o, n, ratios, fmt, good="no slower", bad="slower"):
        r = n / o
        lo, hi = min(ratios), max(ratios)
        print(f"  {label}: old {fmt(o)}, new {fmt(n)}, new/old {r:.3f}; rounds: "
              + " ".join(f"{x:.3f}" for x in ratios))
        rows.append(md_row([label, fmt(o), fmt(n), f"{r:.3f}", f"{lo:.3f} to {hi:.3f} ({len(ratios)} round{'s' if len(ratios) > 1 else ''})",
                            judge(r, lo, good, bad)]))
    ms = lambda v: f"{v:.2f} ms"

    # 1. run -- true: hyperfine's times, each round's median per build.
    # The CPU time (user + sys of the process and the children it waited for, hyperfine's mean
    # per round) is less at the mercy of other jobs on the machine than the wall time.
    times, cpu, ratios, cratios = {"old": [], "new": []}, {"old": [], "new": []}, [], []
    rnum = lambda f: int(re.search(r"\.r(\d+)\.json$", f).group(1))
    for f in sorted(glob.glob(f"{d}/house-startup.r*.json"), key=rnum):
        med, c = {}, {}
        for res in json.load(open(f))["results"]:
            t = [x * 1000 for x in res["times"]]
            times[res["command"]].extend(t)
            med[res["command"]] = statistics.median(t)
            c[res["command"]] = (res["user"] + res["system"]) * 1000
            cpu[res["command"]].append(c[res["command"]])
        ratios.append(med["new"] / med["old"])
        cratios.append(c["new"] / c["old"])
    if ratios:
        row("`taskbox run -- true`, wall, median", statistics.median(times["old"]),
            statistics.median(times["new"]), ratios, ms)
        row("`taskbox run -- true`, CPU (user+sys), mean", statistics.mean(cpu["old"]),
            statistics.mean(cpu["new"]), cratios, ms)

    # 2-4. the bench client's figures: series "http old" and "http new", each with its rounds.
    def client(fig, label, metric="", p99=False):
        try:
            j = json.load(open(f"{d}/house-{fig}.json"))
        except FileNotFoundError:
            return
        s = {x["name"]: x for x in j["series"]}
        o, n = s[f"http old{metric}"], s[f"http new{metric}"]
        for p in ("p50", "p99") if p99 else ("p50",):
            rs = [b[f"{p}_ms"] / a[f"{p}_ms"] for a, b in zip(o["rounds"], n["rounds"])]
            row(f"{label}, {p} (n={o['n']} each)", o[f"{p}_ms"], n[f"{p}_ms"], rs, ms)
    client("exec", "`exec /bin/true` over HTTP (Unix socket)", p99=True)
    client("diff", f"`diff` after 1 change in {files:,} files, HTTP")
    client("checkpoint", f"checkpoint, {files:,} files, 10 changed, HTTP", " checkpoint")
    client("checkpoint", f"restore, {files:,} files, 10 changed, HTTP", " restore")

    # 5. VmRSS of a fresh supervisor of each build with COUNT idle sandboxes, round by round.
    idle = {}
    for side in ("old", "new"):
        for f in glob.glob(f"{d}/house-idle-{side}.r*.json"):
            idle.setdefault(rnum(f), {})[side] = json.load(open(f))
    pairs = [v for _, v in sorted(idle.items()) if len(v) == 2]
    if pairs:
        count = pairs[0]["old"]["count"]
        rss = {side: [p[side]["with_sandboxes"]["rss_mib"] for p in pairs] for side in ("old", "new")}
        for side in ("old", "new"):
            p = pairs[-1][side]
            init = {x["comm"]: x for x in p["with_sandboxes"]["descendants"]}.get("taskbox-init")
            print(f"  idle, {side}: VmRSS {p['before']['rss_mib']:.1f} MiB with no sandbox, "
                  f"{p['with_sandboxes']['rss_mib']:.1f} with {count}, {p['after_destroy']['rss_mib']:.1f}"
                  f" after destroying them" + (f"; taskbox-init {init['rss_mib'] / count:.2f} MiB RSS,"
                  f" {init['pss_mib'] / count:.2f} MiB PSS per sandbox" if init else ""))
        row(f"supervisor VmRSS, {count} idle sandboxes (median of rounds)", statistics.median(rss["old"]),
            statistics.median(rss["new"]), [b / a for a, b in zip(rss["old"], rss["new"])],
            lambda v: f"{v:.1f} MiB", good="no larger", bad="larger")

    # Context: each supervisor's CPU over a whole figure (one reading each, no rounds).
    try:
        lines = open(f"{d}/house-cpu.txt").read().split()
    except FileNotFoundError:
        lines = []
    for fig, o, n in zip(lines[0::3], lines[1::3], lines[2::3]):
        o, n = int(o), int(n)
        print(f"  CPU of each supervisor and its sandboxes over the {fig} figure: old {o} ms, new {n} ms")
        if o > 0:
            rows.append(md_row([f"(context) CPU of the supervisor and its sandbox over the {fig} figure,"
                                " set-up included", f"{o / 1000:.2f} s", f"{n / 1000:.2f} s",
                                f"{n / o:.3f}", "one reading each", ""]))

    with open(out, "w") as fh:
        fh.write(f"| figure | old: {old_name} | new: {new_name} | new/old | new/old over rounds (spread) | verdict |\n")
        fh.write("|---|---|---|---|---|---|\n")
        fh.writelines(rows)

getattr(sys.modules[__name__], sys.argv[1])(sys.argv[2:])
PY
py() { python3 "$SCRATCH/helpers.py" "$@"; }

# Runs hyperfine in rounds: hf_rounds NAME [hyperfine options and commands...]; the exports are
# $SCRATCH/NAME.rN.json. The order of the commands alternates between rounds.
hf_rounds() {
  local name=$1
  shift
  local opts=() cmds=() r
  while [ $# -gt 0 ]; do
    case "$1" in
      -n) cmds+=("$1" "$2" "$3"); shift 3 ;;
      *) opts+=("$1"); shift ;;
    esac
  done
  for ((r = 1; r <= ROUNDS; r++)); do
    local ordered=("${cmds[@]}")
    if ((r % 2 == 0)); then
      ordered=()
      local i
      for ((i = ${#cmds[@]} - 3; i >= 0; i -= 3)); do ordered+=("${cmds[@]:i:3}"); done
    fi
    echo "   round $r/$ROUNDS" >&2
    hyperfine -N --style none --warmup 3 --runs "$RUNS" "${opts[@]}" \
      --export-json "$SCRATCH/$name.r$r.json" "${ordered[@]}" >/dev/null
  done
}
hf_files() { ls "$SCRATCH/$1".r*.json; }

# ---- machine ---------------------------------------------------------------------------------
machine_notes() {
  local cpu mem rootfs
  cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
  mem=$(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)
  rootfs=$(findmnt -no FSTYPE,OPTIONS --target "$SCRATCH" 2>/dev/null | head -1 || true)
  echo "date:      $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "kernel:    $(uname -r)"
  echo "cpu:       $(nproc) x ${cpu:-unknown}; memory $mem"
  echo "scratch fs: ${rootfs:-unknown} (state dir and workspaces)"
  echo "cgroups:   $(stat -fc %T /sys/fs/cgroup) at /sys/fs/cgroup; taskbox reports" \
    "$("$TASKBOX" run --json --workspace "$SCRATCH/ws" -- true | py jsonfield /dev/stdin enforcement.limits)"
  echo "load:      $(cut -d' ' -f1-3 /proc/loadavg) (1/5/15 min) at start"
  echo "tools:     $(hyperfine --version), bwrap $(bwrap --version | awk '{print $2}'), $(git --version)"
  echo "taskbox:   $source_desc"
  [ -z "$old_desc" ] || echo "old build: $old_desc (house)"
}
log "machine"
machine_notes | tee "$SCRATCH/machine.txt"

# ---- startup ---------------------------------------------------------------------------------
bench_startup() {
  log "startup: taskbox run -- true vs bwrap (hyperfine, $ROUNDS rounds x $RUNS runs)"
  local ws=$SCRATCH/ws
  local args=(
    -n taskbox "$TASKBOX run --workspace $ws -- true"
    -n "taskbox --policy default" "$TASKBOX run --policy default --workspace $ws -- true"
  )
  if [ -n "$SHM_STATE" ]; then
    args+=(-n "taskbox, state dir on tmpfs" "$TASKBOX run --state-dir $SHM_STATE --workspace $ws -- true")
  fi
  args+=(
    -n bwrap "bwrap --unshare-all --ro-bind / / --dev /dev --proc /proc true"
    -n "true (no sandbox)" "true"
  )
  hf_rounds startup "${args[@]}"
  # shellcheck disable=SC2046
  py hf "$ROWS" "start-up: run -- true" taskbox bwrap sb 2 $(hf_files startup) | tee "$SCRATCH/startup.txt"
}

# ---- profile ---------------------------------------------------------------------------------
perf_ok=
perf_usable() {
  if [ -z "$perf_ok" ]; then
    perf_ok=no
    command -v perf >/dev/null || apt_install linux-perf || true
    if command -v perf >/dev/null; then
      local events
      events=$(perf list 2>/dev/null || true)
      case "$events" in *sched:sched_switch*) perf_ok=yes ;; esac
    fi
    [ $perf_ok = yes ] || echo "  perf with the sched:sched_switch tracepoint is not usable here; profile skipped" >&2
  fi
  [ $perf_ok = yes ]
}

# perf_profile KIND NAME RUNS CMD...: records RUNS runs of CMD system-wide and prints, per run,
# for CMD's process tree only: KIND=off, the off-CPU time by kernel wait site (sched:sched_switch
# with call graphs); KIND=on, the CPU time by syscall (cpu-clock, 10 kHz, with call graphs).
# PERF_PER=N: each run of CMD does N operations, and the figures are per operation instead.
# PERF_SEED="TID...": these threads (and what they fork) count as CMD's too.
perf_profile() {
  local kind=$1 name=$2 runs=$3 per=${PERF_PER:-1}
  shift 3
  local data=$SCRATCH/$name.perf event=(-e sched:sched_switch)
  [ "$kind" = on ] && event=(-e cpu-clock/period=100000/)
  perf record -q -o "$data" -a -g "${event[@]}" -e sched:sched_process_fork -- \
    bash -c 'echo $$ > "$2.root"; s=$(date +%s%N); n=$1; o=$2; shift 2
             for ((i = 0; i < n; i++)); do "$@" >/dev/null; done
             echo $(( ($(date +%s%N) - s) / n / 1000 )) > "$o.wall"' _ "$runs" "$SCRATCH/$name" "$@" \
    2>"$SCRATCH/perf.err" \
    || { echo "  perf record failed: $(tail -1 "$SCRATCH/perf.err")" >&2; return 0; }
  echo "  wall per run while recording: $(echo "$(cat "$SCRATCH/$name.wall") / 1000 / $per" | bc -l | xargs printf '%.2f') ms"
  perf script -i "$data" -F comm,pid,tid,time,event,period,trace,ip,sym 2>/dev/null \
    | py "${kind}cpu" "$((runs * per))" "$(cat "$SCRATCH/$name.root")" | tee "$SCRATCH/$name.txt"
}

bench_profile() {
  log "profile: where the start-up time goes (perf, $PROFILE_RUNS runs of run -- true; off-CPU, then on-CPU)"
  perf_usable || return 0
  local cpu_tb cpu_bw
  cpu_tb=$(perf stat -x, -r "$PROFILE_RUNS" -e task-clock -- "$TASKBOX" run --workspace "$SCRATCH/ws" -- true \
    2>&1 >/dev/null | awk -F, '/task-clock/ {printf "%.1f", $1}' || true)
  cpu_bw=$(perf stat -x, -r "$PROFILE_RUNS" -e task-clock -- bwrap --unshare-all --ro-bind / / --dev /dev --proc /proc true \
    2>&1 >/dev/null | awk -F, '/task-clock/ {printf "%.1f", $1}' || true)
  echo "  CPU time per run, whole process tree (perf stat task-clock): taskbox ${cpu_tb:-?} ms, bwrap ${cpu_bw:-?} ms"
  perf_profile off profile-startup-off "$PROFILE_RUNS" \
    "$TASKBOX" run --workspace "$SCRATCH/ws" -- true
  perf_profile on profile-startup-on "$PROFILE_RUNS" \
    "$TASKBOX" run --workspace "$SCRATCH/ws" -- true
  echo "  for comparison, bwrap:"
  perf_profile on profile-bwrap-on "$PROFILE_RUNS" \
    bwrap --unshare-all --ro-bind / / --dev /dev --proc /proc true
}

# ---- diff ------------------------------------------------------------------------------------
# The FILES-file git workspace $SCRATCH/repo (d0/f0.txt ... d999/f99.txt, committed), with one
# change in the tree itself: d0/f0.txt has one more line. Made once, for diff and api.
# `make_repo DIR N clean`: the same of N files in DIR, without the change.
make_repo() {
  local ws=${1:-$SCRATCH/repo} files=${2:-$FILES}
  local dirs=$((files / 100))
  [ -d "$ws" ] && return 0
  log "building a $files-file git workspace ($dirs directories)"
  python3 - "$ws" "$dirs" "$files" <<'PY'
import os, sys
root, dirs, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
per = files // dirs
for d in range(dirs):
    p = os.path.join(root, f"d{d}")
    os.makedirs(p)
    for f in range(per):
        with open(os.path.join(p, f"f{f}.txt"), "w") as fh:
            fh.write(f"file {d}/{f}\n")
PY
  git -C "$ws" init -q
  # No automatic gc/maintenance: `git commit` would otherwise start a detached repack of the 100k
  # new loose objects that runs during the measurements.
  git -C "$ws" config gc.auto 0
  git -C "$ws" config maintenance.auto false
  git -C "$ws" add -A
  git -C "$ws" -c user.name=bench -c user.email=bench@example.invalid commit -qm workspace
  [ "${3:-}" != clean ] || return 0
  # The same one-file change, applied to the tree itself so that git has something to find;
  # taskbox's command then changes the same file again inside its overlay.
  echo x >> "$ws/d0/f0.txt"
  [ "$(git -C "$ws" status --porcelain)" = " M d0/f0.txt" ] || die "unexpected git status"
}

bench_diff() {
  local ws=$SCRATCH/repo
  make_repo
  "$TASKBOX" run --diff --workspace "$ws" -- sh -c 'echo x >> d0/f0.txt' > "$SCRATCH/diff.out"
  grep -q '^+++ b/d0/f0.txt' "$SCRATCH/diff.out" || die "taskbox --diff did not report the change"
  log "diff: taskbox run --diff vs git status (hyperfine, $ROUNDS rounds x $RUNS runs)"
  hf_rounds diff \
    -n taskbox "$TASKBOX run --diff --workspace $ws -- sh -c 'echo x >> d0/f0.txt'" \
    -n "git status" "git -C $ws status --porcelain" \
    -n "git status -uno" "git -C $ws status --porcelain --untracked-files=no" \
    -n "git diff" "git -C $ws diff"
  # shellcheck disable=SC2046
  py hf "$ROWS" "diff: 1 change in $FILES files" taskbox "git status" bs 10 $(hf_files diff) \
    | tee "$SCRATCH/diff.txt"
  if [ $want_profile = 1 ] && perf_usable; then
    log "profile: where the time of run --diff goes ($PROFILE_RUNS runs)"
    perf_profile off profile-diff "$PROFILE_RUNS" \
      "$TASKBOX" run --diff --workspace "$ws" -- sh -c 'echo x >> d0/f0.txt'
  fi
}

# ---- memory ----------------------------------------------------------------------------------
bench_memory() {
  log "memory: peak RSS while the command writes 1 GiB to stdout ($MEM_RUNS runs per variant, interleaved)"
  local ws=$SCRATCH/ws gib=1073741824 i mode secs rss code
  local cmd=(sh -c "head -c $gib /dev/zero")
  local -A all_secs=() all_rss=() mib=() gibs=()
  sync
  for ((i = 0; i < MEM_RUNS; i++)); do
    for mode in plain json pipe; do
      case $mode in
        plain) /usr/bin/time -v -o "$SCRATCH/time.txt" "$TASKBOX" run --workspace "$ws" -- "${cmd[@]}" >/dev/null ;;
        json) /usr/bin/time -v -o "$SCRATCH/time.txt" "$TASKBOX" run --json --workspace "$ws" -- "${cmd[@]}" >"$SCRATCH/mem.json"
              [ "$(py jsonfield "$SCRATCH/mem.json" stdout.bytes)" = "$gib" ] || die "--json did not count 1 GiB" ;;
        pipe) /usr/bin/time -v -o "$SCRATCH/time.txt" sh -c "head -c $gib /dev/zero | cat >/dev/null" ;;
      esac
      rm -f "$TASKBOX_STATE_DIR"/spill/*
      sync  # start each run without the previous run's writeback in flight
      read -r secs rss code < <(py timev "$SCRATCH/time.txt")
      [ "$code" = 0 ] || die "memory run ($mode) exited $code"
      all_secs[$mode]+=" $secs" all_rss[$mode]+=" $rss"
    done
  done
  echo "  variant                                        wall s (median)  GiB/s  max RSS (max of runs)"
  for mode in plain json pipe; do
    # shellcheck disable=SC2086
    read -r secs _ < <(py stats ${all_secs[$mode]})
    # shellcheck disable=SC2086
    read -r _ rss < <(py stats ${all_rss[$mode]})
    mib[$mode]=$(echo "$rss / 1024" | bc -l | xargs printf '%.1f')
    gibs[$mode]=$(echo "1 / $secs" | bc -l | xargs printf '%.2f')
    case $mode in
      plain) label="taskbox run -- sh -c 'head -c 1GiB /dev/zero'" ;;
      json) label="taskbox run --json -- ..." ;;
      pipe) label="head -c 1GiB /dev/zero | cat (no sandbox)" ;;
    esac
    printf '  %-46s %15s %6s %9s MiB   (runs: %s s)\n' "$label" "$secs" "${gibs[$mode]}" "${mib[$mode]}" "${all_secs[$mode]# }"
  done
  echo "  (the --json ExecResult reports max_rss_bytes=$(py jsonfield "$SCRATCH/mem.json" resources.max_rss_bytes) for the sandbox's own processes)"
  local ok label
  for mode in plain json; do
    ok=$(echo "${mib[$mode]} < 64" | bc)
    label="peak RSS, 1 GiB to stdout"
    [ $mode = json ] && label="$label, --json"
    printf '| %s | %s MiB max RSS; %s GiB/s | %s | %s | %s | %s |\n' "$label" "${mib[$mode]}" "${gibs[$mode]}" \
      "pipe head to cat: ${gibs[pipe]} GiB/s" \
      "throughput $(echo "${gibs[$mode]} / ${gibs[pipe]}" | bc -l | xargs printf '%.2f')x of the pipe's" \
      "< 64 MiB" "$([ "$ok" = 1 ] && echo yes || echo '**no**')" >> "$ROWS"
  done
}

# ---- api -------------------------------------------------------------------------------------
# serve_start NAME [BINARY]: starts `taskbox serve` (of BINARY, default $TASKBOX) on
# $SCRATCH/NAME.sock with state $SCRATCH/NAME-state (stderr to $SCRATCH/NAME.log) and waits for its
# socket; sets SERVE_PID and SERVE_SOCK.
serve_start() {
  local i
  SERVE_SOCK=$SCRATCH/$1.sock
  "${2:-$TASKBOX}" --state-dir "$SCRATCH/$1-state" --socket "$SERVE_SOCK" serve \
    --max-sandboxes "$API_IDLE" --max-sandboxes-per-tenant "$API_IDLE" 2>"$SCRATCH/$1.log" &
  SERVE_PID=$!
  for ((i = 0; i < 100; i++)); do
    [ -S "$SERVE_SOCK" ] && return 0
    kill -0 "$SERVE_PID" 2>/dev/null || break
    sleep 0.1
  done
  die "taskbox serve did not start: $(tail -3 "$SCRATCH/$1.log")"
}
# The thread ids of PID and of all its descendants.
tree_tids() {
  local c
  ls "/proc/$1/task" 2>/dev/null | tr '\n' ' ' || true
  for c in $(cat /proc/"$1"/task/*/children 2>/dev/null); do tree_tids "$c"; done
}
serve_stop() {
  [ -n "$SERVE_PID" ] || return 0
  kill -TERM "$SERVE_PID" 2>/dev/null || true
  wait "$SERVE_PID" 2>/dev/null || true
  SERVE_PID=
}

bench_api() {
  make_repo
  local ws=$SCRATCH/ws repo=$SCRATCH/repo client=("$BENCH_CLIENT")
  local lib=(--lib-state-dir "$SCRATCH/api-lib" --lib-traced)
  [ -z "$SHM_STATE" ] || lib+=(--lib-tmpfs-state-dir "$SHM_STATE/api-lib")
  local compare=(--compare "taskbox run -- true=$TASKBOX run --workspace $ws -- true")
  local docker_note="not measured: `docker info` failed (no Docker daemon is running here)"
  if ! command -v docker >/dev/null; then
    docker_note="not measured: no docker client installed"
  elif docker info >/dev/null 2>&1; then
    local image=${BENCH_DOCKER_IMAGE:-debian:stable-slim}
    if DOCKER_CID=$(docker run -d --rm --network none "$image" sleep infinity 2>"$SCRATCH/docker.err"); then
      compare+=(--compare "docker exec=docker exec $DOCKER_CID true")
      docker_note=
    else
      DOCKER_CID=
      docker_note="not measured: docker run $image failed: $(tail -1 "$SCRATCH/docker.err")"
    fi
  fi
  [ -z "$docker_note" ] || echo "  docker exec: $docker_note" >&2
  serve_start api
  log "api: exec /bin/true round trips ($API_ROUNDS rounds; $API_RUNS per series) beside one-shot runs"
  "${client[@]}" exec --socket "$SERVE_SOCK" "${lib[@]}" --workspace "$ws" --runs "$API_RUNS" \
    --warmup 100 --rounds "$API_ROUNDS" "${compare[@]}" --compare-runs $((API_ROUNDS * 15)) \
    >"$SCRATCH/api-exec.json"
  log "api: diff after 1 change in $FILES files ($API_DIFF_RUNS per series) beside git status"
  "${client[@]}" diff --socket "$SERVE_SOCK" "${lib[@]}" --workspace "$repo" --change d0/f0.txt \
    --runs "$API_DIFF_RUNS" --warmup 3 --rounds "$API_ROUNDS" \
    --compare "git status --porcelain=git -C $repo status --porcelain" \
    --compare-runs "$API_DIFF_RUNS" --compare-warmup 1 >"$SCRATCH/api-diff.json"
  log "api: checkpoint, change, restore with 10 changed files ($API_CYCLES cycles per series)"
  "${client[@]}" checkpoint --socket "$SERVE_SOCK" "${lib[@]}" --workspace "$repo" --changed 10 \
    --runs "$API_CYCLES" --warmup 1 --rounds "$API_ROUNDS" >"$SCRATCH/api-checkpoint.json"
  if [ $want_profile = 1 ] && perf_usable; then
    local n=500 m=30 seed
    seed=$(tree_tids "$SERVE_PID")
    log "profile: where an exec round trip goes (perf, $n execs over HTTP; the supervisor, its sandbox and the client; per exec)"
    PERF_PER=$n PERF_SEED=$seed perf_profile off profile-api-exec-off 1 \
      "$BENCH_CLIENT" exec --socket "$SERVE_SOCK" --workspace "$ws" --runs $n --warmup 0 --rounds 1
    PERF_PER=$n PERF_SEED=$seed perf_profile on profile-api-exec-on 1 \
      "$BENCH_CLIENT" exec --socket "$SERVE_SOCK" --workspace "$ws" --runs $n --warmup 0 --rounds 1
    log "profile: where a cycle of checkpoint, 10 writes and restore goes (perf, $m cycles over HTTP; per cycle)"
    PERF_PER=$m PERF_SEED=$seed perf_profile off profile-api-checkpoint-off 1 \
      "$BENCH_CLIENT" checkpoint --socket "$SERVE_SOCK" --workspace "$repo" --runs $m --warmup 0 --rounds 1
    PERF_PER=$m PERF_SEED=$seed perf_profile on profile-api-checkpoint-on 1 \
      "$BENCH_CLIENT" checkpoint --socket "$SERVE_SOCK" --workspace "$repo" --runs $m --warmup 0 --rounds 1
  fi
  local wl_rss wl_reqs="?"
  wl_rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$SERVE_PID/status")
  if command -v curl >/dev/null; then
    wl_reqs=$(curl -sf --unix-socket "$SERVE_SOCK" http://localhost/metrics \
      | awk '/^taskbox_http_requests_total/ {n += $NF} END {print n}' || echo "?")
  fi
  serve_stop
  log "api: supervisor memory with $API_IDLE idle sandboxes (a fresh supervisor)"
  serve_start idle
  "${client[@]}" idle --socket "$SERVE_SOCK" --pid "$SERVE_PID" --workspace "$repo" \
    --count "$API_IDLE" >"$SCRATCH/api-idle.json"
  serve_stop
  py api "$ROWS" "$SCRATCH" "$docker_note" "$wl_rss" "$wl_reqs" "$FILES" | tee "$SCRATCH/api.txt"
}

# ---- fork (issue 19) -------------------------------------------------------------------------
# A supervisor whose limits do not bound the figure: density and rate measure the machine.
# FLEET_FLAGS: more flags for it (the warm pool of forks; none by default, so that density and
# rate count only the sandboxes they make).
fleet_serve() {
  local i
  SERVE_SOCK=$SCRATCH/$1.sock
  # shellcheck disable=SC2086
  "$TASKBOX" --state-dir "$SCRATCH/$1-state" --socket "$SERVE_SOCK" serve \
    --max-sandboxes 100000 --max-sandboxes-per-tenant 100000 --max-starting 64 \
    --max-starting-per-tenant 64 ${FLEET_FLAGS:---fork-pool 0} 2>"$SCRATCH/$1.log" &
  SERVE_PID=$!
  for ((i = 0; i < 100; i++)); do
    [ -S "$SERVE_SOCK" ] && return 0
    kill -0 "$SERVE_PID" 2>/dev/null || break
    sleep 0.1
  done
  die "taskbox serve did not start: $(tail -3 "$SCRATCH/$1.log")"
}

bench_fork() {
  make_repo
  local repo=$SCRATCH/repo ws=$SCRATCH/ws
  local pool=${BENCH_FORK_POOL:-16} cold_sock cold_pid
  # Two supervisors side by side: without the warm pool of forks, and with it.
  FLEET_FLAGS="--fork-pool 0" fleet_serve fork-cold
  cold_sock=$SERVE_SOCK cold_pid=$SERVE_PID
  FLEET_FLAGS="--fork-pool $pool" fleet_serve fork
  log "fork: 1 -> 16 of a sandbox with 10 changed files in $FILES files, until all 16 answer an exec; a warm pool of $pool against none, interleaved"
  "$BENCH_CLIENT" fork --socket "$SERVE_SOCK" --cold-socket "$cold_sock" \
    --lib-state-dir "$SCRATCH/fork-lib" --lib-pool "$pool" \
    --workspace "$repo" --count 16 --changed 10 --runs "${BENCH_FORK_RUNS:-20}" --warmup 2 \
    >"$SCRATCH/fork.json"
  serve_stop
  SERVE_PID=$cold_pid
  serve_stop
  fleet_serve fork-rate
  log "rate: create + exec + destroy by 8 clients for ${BENCH_RATE_SECS:-20} s"
  "$BENCH_CLIENT" rate --socket "$SERVE_SOCK" --lib-state-dir "$SCRATCH/rate-lib" \
    --workspace "$ws" --clients 8 --secs "${BENCH_RATE_SECS:-20}" >"$SCRATCH/rate.json"
  serve_stop
  log "density: live idle sandboxes until a create fails (at most ${BENCH_DENSITY_MAX:-768})"
  fleet_serve density
  "$BENCH_CLIENT" density --socket "$SERVE_SOCK" --pid "$SERVE_PID" --workspace "$ws" \
    --max "${BENCH_DENSITY_MAX:-768}" --floor-mib "${BENCH_DENSITY_FLOOR_MIB:-4096}" \
    >"$SCRATCH/density.json"
  serve_stop
  python3 - "$SCRATCH" "$ROWS" <<'PY' | tee "$SCRATCH/fork.txt"
import json, sys
d, rows = sys.argv[1], sys.argv[2]
fork = json.load(open(f"{d}/fork.json"))
rate = json.load(open(f"{d}/rate.json"))
den = json.load(open(f"{d}/density.json"))
out = []
for s in fork["series"]:
    a, f = s["fork_to_all_answering"], s["fork_request"]
    met = "yes" if s["api"] == "http" and a["p50_ms"] < 50 else ("no" if s["api"] == "http" else "")
    pooled = f"; {s.get('forks_from_the_pool', 0)} of {s.get('forks_measured', 0)} forks from the pool"
    ab = s.get("ab")
    ratio = ""
    if ab:
        ratio = f"; pool / no pool, round by round: p50 {ab['pool_over_no_pool_p50']:.2f} (min {ab['min']:.2f}, max {ab['max']:.2f})"
    out.append(f"| fork 1 -> 16, 10 changed files in the 100,000-file workspace, until all 16 answer an exec ({s['api']}) | p50 {a['p50_ms']} ms, p90 {a['p90_ms']}, max {a['max_ms']} (n={a['n']}); the fork request alone p50 {f['p50_ms']} ms{pooled}{ratio} | | | < 50 ms | {met} |")
for s in rate["series"]:
    c = s["cycle"]
    met = "yes" if s["api"] == "http" and s["per_second"] >= 100 else ("no" if s["api"] == "http" else "")
    out.append(f"| sustained create + exec + destroy, 8 clients ({s['api']}) | {s['per_second']:.1f} per second ({s['cycles']} in {s['seconds']:.1f} s); cycle p50 {c['p50_ms']} ms, p99 {c['p99_ms']} | | | >= 100 / s | {met} |")
h = den["host_mem_available_mib"]
sup = den["supervisor"]["with_sandboxes"]
n = den["sandboxes"]
met = "yes" if n >= 512 else "no"
out.append(f"| live idle sandboxes ({den['stopped_because']}) | {n} ({den['answering_at_the_end']} answering at the end); host memory {h['per_sandbox_kib']} KiB per sandbox (MemAvailable {h['before']} -> {h['with_sandboxes']} MiB); supervisor VmRSS {sup['rss_mib']:.1f} MiB | | | >= 512 | {met} |")
open(rows, "a").write("\n".join(out) + "\n")
print("\n".join(out))
PY
}

# ---- docker ----------------------------------------------------------------------------------
bench_docker() {
  if ! docker info >/dev/null 2>&1; then
    echo "| docker backend | not measured: no Docker daemon answers | | | | |" >>"$ROWS"
    return 0
  fi
  local root=$SCRATCH/docker-rootfs image=taskbox-bench/busybox:latest a
  mkdir -p "$root/bin" "$root/etc" "$root/tmp" "$root/workspace" "$SCRATCH/docker-ws"
  cp /bin/busybox "$root/bin/busybox"
  for a in $(/bin/busybox --list); do [ "$a" = busybox ] || ln -sf busybox "$root/bin/$a"; done
  printf 'root:x:0:0::/root:/bin/sh\nu:x:1000:1000::/tmp:/bin/sh\n' >"$root/etc/passwd"
  tar -C "$root" -c . | docker import -c 'USER 1000:1000' -c 'WORKDIR /workspace' \
    -c 'ENV PATH=/bin' - "$image" >/dev/null
  echo x >"$SCRATCH/docker-ws/f"
  log "docker: warm-pool create-to-first-exec vs docker run --rm; exec true vs docker exec"
  "$BENCH_CLIENT" docker --image "$image" --workspace "$SCRATCH/docker-ws" \
    --state-dir "$SCRATCH/docker-state" --create-runs "${BENCH_DOCKER_CREATES:-40}" \
    --exec-runs "${BENCH_DOCKER_EXECS:-400}" >"$SCRATCH/docker.json"
  python3 - "$SCRATCH/docker.json" >>"$ROWS" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
s = {x["name"]: x for x in d["series"]}
def ms(x): return f'{x["p50_ms"]:.1f} ms (p99 {x["p99_ms"]:.1f})'
pool = s["create+first exec, warm pool (backend)"]; run = s["docker run --rm IMAGE true (cold, CLI)"]
ex = s["exec true (backend)"]; cli = s["docker exec CONTAINER true (CLI)"]
r1 = d["docker_run_over_pool_create_p50"]; r2 = d["backend_exec_over_docker_exec_p50"]
print(f"| docker: create+first exec from the warm pool vs `docker run --rm IMAGE true` | {ms(pool)} | {ms(run)} | {r1:.1f}x faster | >= 5x | {'yes' if r1 >= 5 else 'no'} |")
print(f"| docker: `exec true` via the backend vs `docker exec CONTAINER true` | {ms(ex)} | {ms(cli)} | {r2:.2f} | <= 1 | {'yes' if r2 <= 1 else 'no'} |")
PY
}

# ---- egress ----------------------------------------------------------------------------------
bench_egress() {
  command -v curl >/dev/null || apt_install curl || die "curl not found"
  log "egress: $((EGRESS_BYTES >> 20)) MiB downloads and new connections, ${EGRESS_ROUNDS} rounds"
  TASKBOX_INIT=$(dirname "$TASKBOX")/taskbox-init "$BENCH_CLIENT" egress \
    --state-dir "$SCRATCH/egress" --workspace "$SCRATCH/ws" --bytes "$EGRESS_BYTES" \
    --rounds "$EGRESS_ROUNDS" --conns "$EGRESS_CONNS" >"$SCRATCH/egress.json"
  py egress "$ROWS" "$SCRATCH/egress.json" | tee "$SCRATCH/egress.txt"
  # Why the proxy keeps its second hop: the in-kernel redirect that would skip it (as root; it
  # measures direct and relay only without CAP_BPF).
  log "egress: one relay hop, $((EGRESS_BYTES >> 20)) MiB: direct, splice relay, sockmap redirect"
  "$BENCH_CLIENT" egress-hop --bytes "$EGRESS_BYTES" --rounds "$EGRESS_ROUNDS" >"$SCRATCH/egress-hop.json"
  py egress_hop "$ROWS" "$SCRATCH/egress-hop.json" | tee -a "$SCRATCH/egress.txt"
}

# ---- egress-tls ------------------------------------------------------------------------------
bench_egress_tls() {
  log "egress-tls: an inspected host against a plain tunnel, ${BENCH_TLS_ROUNDS:-10} rounds of ${BENCH_TLS_REQUESTS:-200} requests per series"
  "$BENCH_CLIENT" egress-tls --rounds "${BENCH_TLS_ROUNDS:-10}" \
    --requests "${BENCH_TLS_REQUESTS:-200}" >"$SCRATCH/egress-tls.json"
  py egress_tls "$ROWS" "$SCRATCH/egress-tls.json" | tee "$SCRATCH/egress-tls.txt"
}

# ---- replay ----------------------------------------------------------------------------------
bench_replay() {
  log "replay: a ${BENCH_REPLAY_OPS:-1000}-operation trace, replayed ${BENCH_REPLAY_ROUNDS:-5} times"
  "$BENCH_CLIENT" replay --taskbox "$TASKBOX" --dir "$SCRATCH/replay" \
    --ops "${BENCH_REPLAY_OPS:-1000}" --rounds "${BENCH_REPLAY_ROUNDS:-5}" >"$SCRATCH/replay.json"
  python3 - "$SCRATCH/replay.json" >>"$ROWS" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
b, e, w = d["backend_ms"]["mean_ms"], d["engine_ms"]["mean_ms"], d["wall_ms"]["mean_ms"]
eo, po = d["engine_overhead_pct"], d["process_overhead_pct"]
print(f"| replay of {d['ops']} ops: engine time beyond the backend's calls | {e:.0f} ms | {b:.0f} ms in the backend | +{eo:.1f}% | < 5% | {'yes' if eo < 5 else 'no'} |")
print(f"| replay of {d['ops']} ops: whole `taskbox replay` process beyond the backend's calls | {w:.0f} ms | {b:.0f} ms in the backend | +{po:.1f}% | (informative) | |")
PY
}

# ---- sdk -------------------------------------------------------------------------------------
# The Python SDK's exec against inspect's local sandbox (issue 15's "Measured"), interleaved in
# rounds in one Python process, against a supervisor of this build on a Unix socket.
bench_sdk() {
  python3 -c 'import pydantic, inspect_ai' 2>/dev/null \
    || die "sdk: python3 lacks pydantic or inspect-ai (pip install pydantic inspect-ai)"
  serve_start sdk
  log "sdk: exec true through the Python SDK vs inspect's local sandbox (${BENCH_SDK_ROUNDS:-5} rounds x ${BENCH_SDK_EXECS:-200} each)"
  python3 "$repo/scripts/bench_sdk.py" --socket "$SERVE_SOCK" --workspace "$SCRATCH/ws" \
    --rounds "${BENCH_SDK_ROUNDS:-5}" --execs "${BENCH_SDK_EXECS:-200}" \
    --creates "${BENCH_SDK_CREATES:-40}" >"$SCRATCH/sdk.json"
  serve_stop
  python3 - "$SCRATCH/sdk.json" <<'PY' | tee -a "$ROWS"
import json, sys
d = json.load(open(sys.argv[1]))
s, l = d["sides"]["sdk"], d["sides"]["local"]
r, rr = s["p50"] / l["p50"], d["round_ratios"]
ok = "yes" if r <= 1 else "no"
print(f"| `exec true` through the Python SDK (sync) vs inspect `local`, p50 (n={s['n']} each) | {s['p50']:.2f} ms (p99 {s['p99']:.2f}) | {l['p50']:.2f} ms (p99 {l['p99']:.2f}) | {r:.2f}x ({min(rr):.2f} to {max(rr):.2f} over {len(rr)} rounds) | <= 1x | {ok} |")
if "sdk_async" in d["sides"]:
    a = d["sides"]["sdk_async"]
    print(f"| same, the SDK's async client | {a['p50']:.2f} ms (p99 {a['p99']:.2f}) | {l['p50']:.2f} ms | {a['p50'] / l['p50']:.2f}x | (reported) | |")
c = d.get("create_destroy")
if c:
    print(f"| sandbox create + destroy through the SDK (n={c['n']}) | p50 {c['p50']:.1f} ms, p99 {c['p99']:.1f} ms | | | (reported) | |")
PY
}

# ---- peers -----------------------------------------------------------------------------------
# Issue 17's table: what agents run, under taskbox, the Codex sandbox and sandbox-runtime.
bench_peers() {
  local dir=${BENCH_PEERS_DIR:-${HOME:-/root}/.cache/taskbox-bench/peers} repo20k=$SCRATCH/peers-repo
  local codex srt ws=$SCRATCH/ws
  if [ ! -x "$dir/node_modules/.bin/codex" ] || [ ! -x "$dir/node_modules/.bin/srt" ]; then
    command -v npm >/dev/null || apt_install npm || die "npm not found (needed to install the peers)"
    log "peers: installing @openai/codex and @anthropic-ai/sandbox-runtime in $dir"
    mkdir -p "$dir"
    npm install --prefix "$dir" --no-audit --no-fund --silent \
      @openai/codex @anthropic-ai/sandbox-runtime >&2 || die "npm install of the peers failed"
  fi
  # sandbox-runtime's Linux sandbox is bubblewrap with socat (its proxies) and ripgrep.
  for t in rg:ripgrep socat:socat; do
    command -v "${t%%:*}" >/dev/null || apt_install "${t#*:}" || die "sandbox-runtime needs ${t#*:}"
  done
  codex=$dir/node_modules/.bin/codex srt=$dir/node_modules/.bin/srt
  "$codex" sandbox -- true || die "codex sandbox -- true failed"
  "$srt" true || die "srt true failed"
  make_repo "$repo20k" 20000 clean
  # The same interpreter on both sides: the sandbox's fixed PATH finds the system's python3, and
  # the host's PATH may find another first.
  local py=/usr/bin/python3 suites=$SCRATCH/peers-suites crates=${CARGO_HOME:-${HOME:-/root}/.cargo}/registry/src
  [ -x "$py" ] || die "peers: $py not found"
  # A PyPI package's own tests from its sdist, and two crates' unit tests (test binaries built
  # here by cargo, run bare and in the sandbox).
  mkdir -p "$suites"
  "$py" -m pip download -q --no-deps --no-binary :all: more-itertools==10.5.0 -d "$dir/sdists" >&2     || [ -f "$dir/sdists/more-itertools-10.5.0.tar.gz" ] || die "peers: cannot download the more-itertools sdist"
  tar -xzf "$dir/sdists/more-itertools-10.5.0.tar.gz" -C "$suites"
  (cd "$suites/more-itertools-10.5.0" && "$py" -m unittest -q 2>/dev/null) || die "peers: the more-itertools tests fail bare"
  (cd "$repo" && cargo fetch -q) || die "peers: cargo fetch failed"
  local crate bins=()
  for crate in aho-corasick memchr; do
    local ver src
    ver=$(awk -v n="$crate" '$0 == "name = \"" n "\"" { getline; gsub(/version = |"/, ""); print; exit }' "$repo/Cargo.lock")
    src=$(ls -d "$crates"/*/"$crate-$ver" 2>/dev/null | head -1)
    [ -n "$src" ] || die "peers: no source of $crate $ver under $crates"
    rm -rf "$suites/$crate" && cp -r "$src" "$suites/$crate"
    (cd "$suites/$crate" && CARGO_TARGET_DIR=$suites/$crate/target cargo test -q --release --lib --no-run >&2 2>/dev/null) \
      || die "peers: cannot build the tests of $crate $ver"
    bins+=("$(ls "$suites/$crate"/target/release/deps/"${crate//-/_}"-* | grep -v '\.d$' | head -1)")
  done
  # A static `true`: no dynamic loader, whose CPU feature probes (cpuid, which traps to the
  # hypervisor of a VM) cost a dynamic `true` most of its time here; what an exec of it costs in
  # the sandbox over bare is the runtime's own. It lives in a workspace of its own (the sandbox's
  # /tmp and /var/tmp are private).
  local static_ws=$SCRATCH/peers-static
  mkdir -p "$static_ws"
  printf 'int main(void) { return 0; }\n' | gcc -static -O2 -x c - -o "$static_ws/true-static" \
    || die "peers: cannot build a static true (gcc and libc6-dev are needed)"
  serve_start peers
  local sb sb_static
  sb=$("$TASKBOX" --socket "$SERVE_SOCK" create --workspace "$repo20k")
  sb_static=$("$TASKBOX" --socket "$SERVE_SOCK" create --workspace "$static_ws")
  log "peers: ${BENCH_PEERS_ROUNDS:-20} interleaved rounds of each row"
  python3 - "$TASKBOX" "$codex" "$srt" "$ws" "$repo20k" "$SERVE_SOCK" "$sb" "$py" "$suites" "$(command -v git)" "$sb_static" "$static_ws" "${bins[@]}" >"$SCRATCH/peers-rows.json" <<'PY'
import json, sys
tb, codex, srt, ws, repo, sock, sb, python, suites, git, sb_static, static_ws, ac, mc = sys.argv[1:]
def peers(argv, shell):
    return [
        {"label": "taskbox", "argv": [tb, "run", "--"] + argv},
        {"label": "codex", "argv": [codex, "sandbox", "--"] + argv},
        {"label": "srt", "argv": [srt, "-c", shell]},
    ]
bwrap = ["bwrap", "--unshare-all", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "true"]
py = [python, "-c", "import json"]
unittest = [python, "-m", "unittest", "-q"]
crate_tests = ["sh", "-c", f"{ac} -q && {mc} -q"]
rows = [
    {"row": "true", "cwd": ws, "sides": [{"label": "bwrap", "argv": bwrap}] + peers(["true"], "true")},
    {"row": "python3 -c 'import json'", "cwd": ws,
     "sides": [{"label": "bare", "argv": py}] + peers(py, f"{python} -c 'import json'")},
    {"row": "git status, 20,000 files, one-shot", "cwd": repo,
     "sides": [{"label": "bare", "argv": [git, "status"]}] + peers([git, "status"], f"{git} status")},
    {"row": "git status, 20,000 files, live sandbox", "cwd": repo,
     "sides": [{"label": "bare", "argv": [git, "status"]},
               {"label": "taskbox", "socket": sock, "sandbox": sb, "argv": [git, "status"]}]},
    {"row": "more-itertools 10.5.0's tests from its sdist (817, unittest)", "rounds": 8,
     "cwd": f"{suites}/more-itertools-10.5.0",
     "sides": [{"label": "bare", "argv": unittest}] + peers(unittest, " ".join(unittest))},
    {"row": "aho-corasick's and memchr's unit tests (163 + 142, release test binaries)", "rounds": 8,
     "cwd": suites,
     "sides": [{"label": "bare", "argv": crate_tests}] + peers(crate_tests, crate_tests[2])},
    {"row": "exec true, live sandbox, from Python's http.client (diagnostic)", "cwd": ws,
     "sides": [{"label": "bare", "argv": ["true"]},
               {"label": "taskbox", "socket": sock, "sandbox": sb, "argv": ["true"]}]},
    {"row": "python3 -c 'import json', live sandbox (diagnostic)", "cwd": repo,
     "sides": [{"label": "bare", "argv": py},
               {"label": "taskbox", "socket": sock, "sandbox": sb, "argv": py}]},
    {"row": "exec of a static true, live sandbox (diagnostic)", "cwd": static_ws,
     "sides": [{"label": "bare", "argv": [f"{static_ws}/true-static"]},
               {"label": "taskbox", "socket": sock, "sandbox": sb_static, "argv": [f"{static_ws}/true-static"]}]},
]
json.dump(rows, sys.stdout)
PY
  # PYTHONDONTWRITEBYTECODE would keep the bare side from the bytecode caches the sandbox (its
  # fixed environment does not set it) writes in its overlay.
  ROUNDS=${BENCH_PEERS_ROUNDS:-20} env -u PYTHONDONTWRITEBYTECODE python3 "$repo/scripts/bench_peers.py" \
    <"$SCRATCH/peers-rows.json" >"$SCRATCH/peers.json"
  # The exec round trip's target again from the Rust client (hyper, as `taskbox exec` and the
  # agent speak it): Python's http.client and json add their own time to the row above.
  log "peers: exec true from the Rust client, 4 rounds of 1000"
  "$BENCH_CLIENT" exec --socket "$SERVE_SOCK" --workspace "$ws" --runs 4000 --rounds 4 \
    >"$SCRATCH/peers-exec.json"
  serve_stop
  python3 - "$SCRATCH/peers.json" "$SCRATCH/peers-exec.json" >"$SCRATCH/peers.md" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
rust = json.load(open(sys.argv[2]))["series"][0]
# Issue 17's targets: (row, the side's ratio to the row's baseline at most, and ahead of codex?)
targets = {
    "true": (1.2, False),
    "python3 -c 'import json'": (1.1, False),
    "git status, 20,000 files, one-shot": (1.5, True),
    "git status, 20,000 files, live sandbox": (1.1, False),
}
for r in rows:
    if "tests" in r["row"]:
        targets[r["row"]] = (1.1, False)
print("| workload (medians of interleaved rounds) | baseline | taskbox | Codex sandbox | sandbox-runtime | target | met |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    s = {x["label"]: x for x in r["sides"]}
    base = r["sides"][0]
    def cell(label):
        x = s.get(label)
        if x is None:
            return ""
        return f"{x['median_ms']:.1f} ms, {x['ratio']:.2f}x ({x['ratio_min']:.2f} to {x['ratio_max']:.2f})"
    t = s["taskbox"]
    if "(diagnostic)" in r["row"]:
        target, met = "", ""
    else:
        at_most, ahead = targets[r["row"]]
        ok = t["ratio"] <= at_most and (not ahead or t["ratio"] < s["codex"]["ratio"])
        target = f"<= {at_most}x" + (", ahead of Codex" if ahead else "")
        met = "yes" if ok else "no"
    print(f"| {r['row']}, {r['rounds']} rounds | {base['label']}: {base['median_ms']:.1f} ms | {cell('taskbox')} | {cell('codex')} | {cell('srt')} | {target} | {met} |")
rounds = ", ".join(f"{x['p50_ms']:.3f}" for x in rust["rounds"])
met = "yes" if rust["p50_ms"] <= 1.0 else "no"
print(f"| exec true, live sandbox, Rust client ({rust['n']} execs) | | p50 {rust['p50_ms']:.3f} ms (rounds: {rounds}), p99 {rust['p99_ms']:.3f} ms | | | p50 <= 1 ms | {met} |")
PY
  cat "$SCRATCH/peers.md" >&2
}

# ---- findings --------------------------------------------------------------------------------
# Issue 16's "Measured": what reading findings costs on a 100 MB test log, and the bytes the
# model reads to learn what failed, with findings first and with head and tail alone.
bench_findings() {
  local ws=$SCRATCH/findings-ws mb=${BENCH_FINDINGS_MB:-100} on_sock on_pid
  mkdir -p "$ws"
  cp "$repo/scripts/findings_log.py" "$ws/"
  python3 "$ws/findings_log.py" --mb "$mb" >"$ws/test.log"
  python3 "$ws/findings_log.py" --mb 1 >"$ws/short.log"
  python3 "$ws/findings_log.py" --mb "$mb" --format go >"$ws/go.log"
  serve_start findings-on
  on_sock=$SERVE_SOCK on_pid=$SERVE_PID
  TASKBOX_FINDINGS=off serve_start findings-off
  log "findings: the cost of reading them on a ${mb} MB test log (${BENCH_FINDINGS_ROUNDS:-101} alternating rounds)"
  "$BENCH_CLIENT" findings-cost --socket "$on_sock" --socket-off "$SERVE_SOCK" --workspace "$ws" \
    --command "generator=python3 findings_log.py --mb $mb" --command "cat=cat test.log" \
    --command "go test -v log=cat go.log" \
    --command "go test -v generator=python3 findings_log.py --mb $mb --format go" \
    --expect adds_two --rounds "${BENCH_FINDINGS_ROUNDS:-101}" >"$SCRATCH/findings-cost.json"
  serve_stop
  log "findings: what the model reads, findings first against head and tail alone"
  local cases=("long log (1 MB, cargo test)|$ws|cat short.log|adds_two|src/calc.rs:12")
  local f
  while IFS= read -r f; do
    [ -n "$f" ] && cases+=("$f")
  done < <(findings_cases)
  local args=()
  for f in "${cases[@]}"; do args+=(--case "$f"); done
  "$BENCH_CLIENT" findings-text --socket "$on_sock" "${args[@]}" >"$SCRATCH/findings-text.json"
  kill -TERM "$on_pid" 2>/dev/null || true
  wait "$on_pid" 2>/dev/null || true
  python3 - "$SCRATCH/findings-cost.json" "$SCRATCH/findings-text.json" <<'PY' | tee -a "$ROWS"
import json, sys
cost, text = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
for c in cost["commands"]:
    ok = "yes" if c["ratio"] < 1.05 else "no"
    print(f"| exec of a 100 MB test log ({c['command']}: `{c['line']}`), findings read vs not, median of {c['rounds']} | {c['findings_on_ms']:.0f} ms | {c['findings_off_ms']:.0f} ms | {c['ratio']:.3f}x (rounds: median {c['ratio_pairs']:.3f}, {c['ratio_min']:.3f} to {c['ratio_max']:.3f}) | < 1.05x | {ok} |")
for r in text["cases"]:
    w, h = r["with_findings_has"], r["head_tail_has"]
    def where(x):
        return "name and location" if x["name"] and x["location"] else ("name only" if x["name"] else ("location only" if x["location"] else "neither"))
    def upto(x):
        return f", location after {x['bytes_to_location']} B" if x["bytes_to_location"] is not None else ""
    print(f"| what the model reads: {r['case']} ({r['output_bytes']} B of output, {r['findings']} findings) | {r['with_findings_bytes']} B, {where(w)}{upto(w)} | head/tail alone: {r['head_tail_bytes']} B, {where(h)}{upto(h)} | | (reported) | |")
PY
}

# The fixture projects of tests/fixtures/findings that bench_findings reads, as cases
# NAME|WORKSPACE|LINE|TEST NAME|FILE:LINE (a copy of each in the scratch directory), for the
# tools this machine has.
findings_cases() {
  local tools=${TASKBOX_FINDINGS_TOOLS:-/opt/taskbox-findings-tools} fx=$SCRATCH/findings-fx
  local cargo_dir path name fixture needs line test at env
  cargo_dir=$(dirname "$(command -v cargo 2>/dev/null || echo /usr/bin/cargo)")
  path="$tools/py/bin:$tools/node/node_modules/.bin:$cargo_dir:/usr/local/bin:/usr/bin:/bin"
  env="export PATH='$path' GOCACHE=/tmp/go-build GOPATH=/tmp/go NO_COLOR=1 RUST_BACKTRACE=0;"
  # NAME|FIXTURE|NEEDS|LINE|TEST NAME|FILE:LINE, as tests/tests/findings.rs plants them.
  while IFS='|' read -r name fixture needs line test at; do
    [ -n "$name" ] || continue
    [ -x "$needs" ] || command -v "$needs" >/dev/null 2>&1 || continue
    rm -rf "${fx:?}/$name"
    mkdir -p "$fx"
    cp -r "$repo/tests/fixtures/findings/$fixture" "$fx/$name"
    echo "$name|$fx/$name|$env $line|$test|$at"
  done <<CASES
pytest|pytest|/usr/bin/python3|/usr/bin/python3 -m pytest -p no:cacheprovider|test_add_negative|tests/test_calc.py:18
unittest|unittest|/usr/bin/python3|/usr/bin/python3 -m unittest discover -s . -p 'test_*.py'|test_title|tests/test_strings.py:9
cargo-test|cargo|cargo|cargo test --offline|adds_negative|src/lib.rs:21
cargo-build|cargo|cargo|cargo build --offline --features broken|E0308|src/lib.rs:7
go-test|go|go|go test ./...|TestAbs/negative|calc/calc_test.go:13
jest|jest|$tools/node/node_modules/.bin/jest|jest --ci|doubles two|math.test.js:8
vitest|vitest|$tools/node/node_modules/.bin/vitest|ln -s $tools/node/node_modules node_modules && vitest run|halves six|math.test.js:9
gcc|gcc|gcc|gcc -Wall -c main.c util.c|undeclared|main.c:7
tsc|tsc|$tools/node/node_modules/.bin/tsc|tsc -p .|TS2322|src/count.ts:5
mypy|mypy|$tools/py/bin/mypy|mypy .|assignment|app.py:5
ruff|ruff|$tools/py/bin/ruff|ruff check .|F401|app.py:2
eslint|eslint|$tools/node/node_modules/.bin/eslint|eslint .|no-unused-vars|app.js:2
CASES
}

# ---- house -----------------------------------------------------------------------------------
# The old build against the new (issue 14's "Measured"): the same figures of both, interleaved
# in rounds within one run, each build with its own state directory and supervisor.
bench_house() {
  make_repo
  local ws=$SCRATCH/ws repo=$SCRATCH/repo r p side sides old_sock new_sock
  local R=$HOUSE_ROUNDS
  echo "  old: $OLD_TASKBOX ($old_desc)"
  echo "  new: $TASKBOX ($source_desc)"
  log "house: taskbox run -- true, old vs new (hyperfine, $R rounds x $HOUSE_RUNS runs each)"
  mkdir -p "$SCRATCH/house-run-old" "$SCRATCH/house-run-new"
  "$OLD_TASKBOX" run --state-dir "$SCRATCH/house-run-old" --workspace "$ws" -- true \
    || die "the old build's run -- true failed"
  "$TASKBOX" run --state-dir "$SCRATCH/house-run-new" --workspace "$ws" -- true \
    || die "the new build's run -- true failed"
  ROUNDS=$R RUNS=$HOUSE_RUNS hf_rounds house-startup \
    -n old "$OLD_TASKBOX run --state-dir $SCRATCH/house-run-old --workspace $ws -- true" \
    -n new "$TASKBOX run --state-dir $SCRATCH/house-run-new --workspace $ws -- true"

  # Both supervisors at once; within each round the client sends one request to each in turn.
  local old_pid new_pid
  serve_start house-old "$OLD_TASKBOX"
  old_pid=$SERVE_PID old_sock=$SERVE_SOCK HOUSE_PIDS=$SERVE_PID SERVE_PID=
  serve_start house-new "$TASKBOX"
  new_pid=$SERVE_PID new_sock=$SERVE_SOCK HOUSE_PIDS="$HOUSE_PIDS $SERVE_PID" SERVE_PID=
  local both=(--socket-as "old=$old_sock" --socket-as "new=$new_sock" --rounds "$R" --interleave)
  : >"$SCRATCH/house-cpu.txt"
  # house_client FIGURE ARGS...: one figure of the client; also the CPU time each supervisor
  # (with its sandboxes' processes) spent on it, set-up included, into house-cpu.txt.
  house_client() {
    local fig=$1 o0 n0 o1 n1
    shift
    o0=$(py treecpu "$old_pid") n0=$(py treecpu "$new_pid")
    "$BENCH_CLIENT" "$fig" "${both[@]}" "$@" >"$SCRATCH/house-$fig.json"
    o1=$(py treecpu "$old_pid") n1=$(py treecpu "$new_pid")
    echo "$fig $((o1 - o0)) $((n1 - n0))" >>"$SCRATCH/house-cpu.txt"
  }
  log "house: exec /bin/true over HTTP, old vs new ($R rounds x $HOUSE_EXECS each, interleaved)"
  house_client exec --workspace "$ws" --runs $((R * HOUSE_EXECS)) --warmup 50
  log "house: diff after 1 change in $FILES files, old vs new ($R rounds x $HOUSE_DIFFS each, interleaved)"
  house_client diff --workspace "$repo" --change d0/f0.txt --runs $((R * HOUSE_DIFFS)) --warmup 2
  log "house: checkpoint, change 10 files, restore, old vs new ($R rounds x $HOUSE_CYCLES cycles each, interleaved)"
  house_client checkpoint --workspace "$repo" --changed 10 --runs $((R * HOUSE_CYCLES)) --warmup 1
  for p in $HOUSE_PIDS; do kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  HOUSE_PIDS=

  log "house: supervisor VmRSS with $API_IDLE idle sandboxes, a fresh supervisor each ($HOUSE_IDLE_ROUNDS rounds)"
  for ((r = 1; r <= HOUSE_IDLE_ROUNDS; r++)); do
    sides="old new"
    ((r % 2 == 0)) && sides="new old"
    for side in $sides; do
      echo "   round $r/$HOUSE_IDLE_ROUNDS: $side" >&2
      if [ $side = old ]; then serve_start "house-idle-old-$r" "$OLD_TASKBOX"; else serve_start "house-idle-new-$r"; fi
      "$BENCH_CLIENT" idle --socket "$SERVE_SOCK" --pid "$SERVE_PID" --workspace "$repo" \
        --count "$API_IDLE" >"$SCRATCH/house-idle-$side.r$r.json"
      serve_stop
      rm -rf "$SCRATCH/house-idle-$side-$r-state"
    done
  done
  py house "$SCRATCH/house.md" "$SCRATCH" "${old_desc%% *}" "${source_desc%% *}" "$FILES" \
    | tee "$SCRATCH/house.txt"
}

bench_queue() {
  local nats port store
  nats=$(command -v nats-server || echo /usr/sbin/nats-server)
  [ -x "$nats" ] || apt_install nats-server || die "nats-server not found (apt-get install nats-server)"
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  store=$SCRATCH/nats-store
  mkdir -p "$store"
  "$nats" -js -a 127.0.0.1 -p "$port" -sd "$store" >"$SCRATCH/nats.log" 2>&1 &
  local nats_pid=$!
  for _ in $(seq 1 100); do (exec 3<>/dev/tcp/127.0.0.1/"$port") 2>/dev/null && break; sleep 0.05; done
  log "queue: submit to a warm worker vs taskbox agent run (${BENCH_QUEUE_ROUNDS:-20} alternating rounds), then ${BENCH_QUEUE_TASKS:-30} tasks on 1, 2 and 3 workers"
  "$BENCH_CLIENT" queue --nats "nats://127.0.0.1:$port" --taskbox "$TASKBOX" --dir "$SCRATCH/queue" \
    --rounds "${BENCH_QUEUE_ROUNDS:-20}" --tasks "${BENCH_QUEUE_TASKS:-30}" >"$SCRATCH/queue.json"
  kill -TERM "$nats_pid" 2>/dev/null || true
  wait "$nats_pid" 2>/dev/null || true
  python3 - "$SCRATCH/queue.json" <<'PY' | tee -a "$ROWS"
import json, sys
r = json.load(open(sys.argv[1]))
o = r["overhead"]
for what, d, q in [("to the start of its sandbox", o["direct_to_sandbox"], o["queue_to_sandbox"]),
                   ("to its end", o["direct_total"], o["queue_total"])]:
    print(f"| the sample task {what}: submit to a warm worker vs `taskbox agent run`, p50 (p99), {o['rounds']} rounds | {q['p50_ms']:.1f} ms ({q['p99_ms']:.1f}) | {d['p50_ms']:.1f} ms ({d['p99_ms']:.1f}) | {q['p50_ms'] / d['p50_ms']:.2f}x | (reported) | |")
base = r["throughput"][0]["tasks_per_second"]
for t in r["throughput"]:
    print(f"| throughput: {t['tasks']} short tasks on {t['workers']} worker(s) | {t['tasks_per_second']:.2f} tasks/s ({t['seconds']:.1f} s) | 1 worker: {base:.2f} tasks/s | {t['tasks_per_second'] / base:.2f}x | (reported) | |")
PY
}

# ---- run -------------------------------------------------------------------------------------
[ $want_startup = 1 ] && bench_startup
[ $want_profile = 1 ] && bench_profile
[ $want_diff = 1 ] && bench_diff
[ $want_memory = 1 ] && bench_memory
[ $want_api = 1 ] && bench_api
[ $want_docker = 1 ] && bench_docker
[ $want_egress = 1 ] && bench_egress
[ $want_egress_tls = 1 ] && bench_egress_tls
[ $want_replay = 1 ] && bench_replay
[ $want_house = 1 ] && bench_house
[ $want_sdk = 1 ] && bench_sdk
[ $want_findings = 1 ] && bench_findings
[ $want_peers = 1 ] && bench_peers
[ $want_queue = 1 ] && bench_queue
[ $want_fork = 1 ] && bench_fork

log "results"
: > "$SCRATCH/results.md"
if [ -s "$ROWS" ] || { [ $want_house = 0 ] && [ $want_peers = 0 ]; }; then
  {
    echo "| figure | taskbox | baseline | ratio | target | met |"
    echo "|---|---|---|---|---|---|"
    cat "$ROWS"
  } >> "$SCRATCH/results.md"
fi
if [ -f "$SCRATCH/peers.md" ]; then
  [ ! -s "$SCRATCH/results.md" ] || echo >> "$SCRATCH/results.md"
  cat "$SCRATCH/peers.md" >> "$SCRATCH/results.md"
fi
if [ -f "$SCRATCH/house.md" ]; then
  [ ! -s "$SCRATCH/results.md" ] || echo >> "$SCRATCH/results.md"
  cat "$SCRATCH/house.md" >> "$SCRATCH/results.md"
fi
cat "$SCRATCH/results.md"
if [ -n "${BENCH_OUT:-}" ]; then
  { cat "$SCRATCH/machine.txt"; echo; cat "$SCRATCH/results.md"; } > "$BENCH_OUT"
fi
