#!/usr/bin/env bash
# Side-by-side benchmarks of taskbox; method, results and findings in BENCHMARKS.md.
#
#   scripts/bench.sh [all|startup|diff|memory|profile]...      (no argument: all)
#
#   startup  `taskbox run -- true` against `bwrap --unshare-all --ro-bind / / --dev /dev --proc /proc
#            true` with hyperfine; reports mean ± stddev and the ratio taskbox/bwrap (target <= 2x).
#   diff     `taskbox run --diff` after a one-file change in a 100,000-file git workspace against
#            `git status --porcelain` on the same tree; ratio git/taskbox (target >= 10x).
#   memory   peak RSS (`/usr/bin/time -v`) and throughput of `taskbox run` (and `--json`) while the
#            command writes 1 GiB to stdout (target < 64 MiB).
#   profile  where taskbox's start-up time goes: off-CPU time of its processes by kernel wait site
#            (perf, sched:sched_switch with call graphs), mean per run.
#   all      startup profile diff memory (the profile is skipped when perf is not usable).
#
# Each hyperfine figure is measured in rounds (BENCH_ROUNDS x BENCH_RUNS runs per command, with
# the commands of a figure alternating between rounds), so a burst of noise on a shared machine
# lands on both sides of a ratio. Ratios are the ones to compare across machines.
#
# Environment:
#   BENCH_TARGET_DIR  cargo target dir for the release build (default: target/bench, separate from
#                     the usual target/ so a benchmark build never waits on a development build)
#   BENCH_NO_BUILD=1  use the binaries already in $BENCH_TARGET_DIR/release
#   TASKBOX_BIN       benchmark this taskbox binary (taskbox-init beside it); skips the build
#   BENCH_ROUNDS      hyperfine rounds per figure (default 3)
#   BENCH_RUNS        runs per command per round (default 15; rounds x runs must be >= 30)
#   BENCH_FILES       files in the diff workspace (default 100000, 100 per directory)
#   BENCH_MEM_RUNS    runs per memory variant (default 3)
#   BENCH_PROFILE_RUNS  runs recorded by the profile (default 20)
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
want_startup=0 want_diff=0 want_memory=0 want_profile=0
[ $# -eq 0 ] && set -- all
for arg in "$@"; do
  case "$arg" in
    all) want_startup=1 want_profile=1 want_diff=1 want_memory=1 ;;
    startup) want_startup=1 ;;
    diff) want_diff=1 ;;
    memory) want_memory=1 ;;
    profile) want_profile=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "bench.sh: unknown benchmark '$arg'" >&2; usage >&2; exit 2 ;;
  esac
done

ROUNDS=${BENCH_ROUNDS:-3}
RUNS=${BENCH_RUNS:-15}
FILES=${BENCH_FILES:-100000}
MEM_RUNS=${BENCH_MEM_RUNS:-3}
PROFILE_RUNS=${BENCH_PROFILE_RUNS:-20}
if [ $((ROUNDS * RUNS)) -lt 30 ]; then
  echo "bench.sh: BENCH_ROUNDS x BENCH_RUNS must be at least 30" >&2
  exit 2
fi

log() { printf '\n== %s\n' "$*" >&2; }
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
for t in cargo git python3; do
  command -v "$t" >/dev/null || [ "$t" = cargo -a -n "${TASKBOX_BIN:-}" ] || die "$t not found"
done

# ---- binaries --------------------------------------------------------------------------------
if [ -n "${TASKBOX_BIN:-}" ]; then
  TASKBOX=$(readlink -f "$TASKBOX_BIN")
else
  target_dir=${BENCH_TARGET_DIR:-target/bench}
  mkdir -p "$target_dir"
  target_dir=$(cd "$target_dir" && pwd)
  if [ "${BENCH_NO_BUILD:-0}" != 1 ]; then
    log "building release binaries (CARGO_TARGET_DIR=$target_dir)"
    CARGO_TARGET_DIR=$target_dir cargo build --release -q -p taskbox -p taskbox-init
  fi
  TASKBOX=$target_dir/release/taskbox
fi
[ -x "$TASKBOX" ] || die "no taskbox binary at $TASKBOX"
[ -x "$(dirname "$TASKBOX")/taskbox-init" ] || die "no taskbox-init beside $TASKBOX"

# ---- scratch space ---------------------------------------------------------------------------
SCRATCH=$(mktemp -d "${TMPDIR:-/var/tmp}/taskbox-bench.XXXXXX")
cleanup() {
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
ROWS=$SCRATCH/rows.tsv
: > "$ROWS"
SHM_STATE=
if [ "$(stat -f -c %T /dev/shm 2>/dev/null || true)" = tmpfs ]; then
  SHM_STATE=$(mktemp -d /dev/shm/taskbox-bench.XXXXXX)
  trap 'rm -rf "$SHM_STATE"; cleanup' EXIT
fi

# The Python helpers: hyperfine aggregation, /usr/bin/time parsing, the off-CPU profile.
cat > "$SCRATCH/helpers.py" <<'PY'
import json, re, statistics, sys, collections

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
        out.write("\t".join([label, f"{sm:.1f} ± {ss:.1f} ms (median {smed:.1f})",
                             f"{base}: {bm:.1f} ± {bs:.1f} ms (median {bmed:.1f})",
                             f"{r:.2f}x ± {err:.2f} (medians {rmed:.2f}x)", ttext,
                             "yes" if ok else "**no**"]) + "\n")
    for name, (m, s, med, _, _) in st.items():
        if name not in (subject, base):
            with open(rows, "a") as out:
                rr = m / bm if direction == "sb" else bm / m
                out.write("\t".join([f"  {label}, {name}", f"{m:.1f} ± {s:.1f} ms (median {med:.1f})",
                                     "", f"{rr:.2f}x", "", ""]) + "\n")

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

def offcpu(args):
    """offcpu RUNS COMMS: from `perf script` of sched:sched_switch -g on stdin, the time each of the
    named processes spent off-CPU, grouped by the kernel frames it blocked in, per run."""
    runs, comms = int(args[0]), set(args[1].split(","))
    evs, ev = [], None
    pat = re.compile(r"\s(\d+\.\d+):\s+sched:sched_switch:\s+prev_comm=(.*?) prev_pid=(\d+) "
                     r"prev_prio=\d+ prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+)")
    for line in sys.stdin:
        m = pat.search(line)
        if m:
            ev = dict(t=float(m.group(1)), pc=m.group(2), pp=int(m.group(3)), st=m.group(4),
                      np=int(m.group(6)), stack=[])
            evs.append(ev)
        elif ev is not None and line.strip():
            parts = line.split()
            if len(parts) >= 2:
                ev["stack"].append(parts[1])
    away, total, count = {}, collections.defaultdict(float), collections.Counter()
    for e in evs:
        if e["np"] in away:
            t0, key = away.pop(e["np"])
            total[key] += e["t"] - t0
            count[key] += 1
        if e["pc"] in comms:
            if e["st"].startswith("R"):
                why = "runnable, waiting for a CPU (preempted)"
            else:
                frames = [f for f in e["stack"] if not SKIP.match(f)]
                call = next((f for f in e["stack"] if f.startswith("__x64_sys_")), "")
                why = " < ".join(frames[:3]) + (f"  [{call[len('__x64_sys_'):]}]" if call else "")
                why = f"{e['st'][0]} {why}"
            away[e["pp"]] = (e["t"], (e["pc"], why))
    print(f"  off-CPU ms/run  times/run  process        blocked in (innermost frames < callers  [syscall])")
    for key, v in sorted(total.items(), key=lambda kv: -kv[1])[:18]:
        print(f"  {v / runs * 1000:13.2f}  {count[key] / runs:9.1f}  {key[0]:<14} {key[1]}")
    print("  (a parent's poll/wait4 rows are time spent waiting for its child: they overlap the"
          " child's rows)")

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
  echo "taskbox:   $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?') (release build)"
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
bench_profile() {
  log "profile: where the start-up time goes (perf sched:sched_switch -g, $PROFILE_RUNS runs)"
  if ! command -v perf >/dev/null; then
    apt_install linux-perf || true
  fi
  if ! command -v perf >/dev/null || ! perf list 2>/dev/null | grep -q 'sched:sched_switch'; then
    echo "  perf with the sched:sched_switch tracepoint is not available here; skipped" >&2
    return 0
  fi
  local ws=$SCRATCH/ws data=$SCRATCH/offcpu.perf t0 t1
  t0=$(date +%s.%N)
  perf record -q -o "$data" -a -g -e sched:sched_switch -- \
    bash -c 'for ((i = 0; i < $1; i++)); do "$2" run --workspace "$3" -- true; done' \
    _ "$PROFILE_RUNS" "$TASKBOX" "$ws" >/dev/null 2>"$SCRATCH/perf.err" \
    || { echo "  perf record failed: $(tail -1 "$SCRATCH/perf.err")" >&2; return 0; }
  t1=$(date +%s.%N)
  echo "  wall per run while recording: $(echo "($t1 - $t0) * 1000 / $PROFILE_RUNS" | bc -l | xargs printf '%.1f') ms"
  perf script -i "$data" -F comm,pid,tid,time,event,trace,ip,sym 2>/dev/null \
    | py offcpu "$PROFILE_RUNS" taskbox,taskbox-init,true | tee "$SCRATCH/profile.txt"
}

# ---- diff ------------------------------------------------------------------------------------
bench_diff() {
  local ws=$SCRATCH/repo dirs=$((FILES / 100))
  log "diff: building a $FILES-file git workspace ($dirs directories)"
  python3 - "$ws" "$dirs" "$FILES" <<'PY'
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
  git -C "$ws" add -A
  git -C "$ws" -c user.name=bench -c user.email=bench@example.invalid commit -qm workspace
  # The same one-file change, applied to the tree itself so that git has something to find;
  # taskbox's command then changes the same file again inside its overlay.
  echo x >> "$ws/d0/f0.txt"
  [ "$(git -C "$ws" status --porcelain)" = " M d0/f0.txt" ] || die "unexpected git status"
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
}

# ---- memory ----------------------------------------------------------------------------------
bench_memory() {
  log "memory: peak RSS while the command writes 1 GiB to stdout ($MEM_RUNS runs per variant)"
  local ws=$SCRATCH/ws gib=1073741824 i mode secs rss code all_secs all_rss
  local cmd=(sh -c "head -c $gib /dev/zero")
  echo "  variant                          wall s (median)  GiB/s   max RSS (max of runs)"
  for mode in plain json baseline; do
    all_secs=() all_rss=()
    for ((i = 0; i < MEM_RUNS; i++)); do
      case $mode in
        plain) /usr/bin/time -v -o "$SCRATCH/time.txt" "$TASKBOX" run --workspace "$ws" -- "${cmd[@]}" >/dev/null ;;
        json) /usr/bin/time -v -o "$SCRATCH/time.txt" "$TASKBOX" run --json --workspace "$ws" -- "${cmd[@]}" >"$SCRATCH/mem.json"
              [ "$(py jsonfield "$SCRATCH/mem.json" stdout.bytes)" = "$gib" ] || die "--json did not count 1 GiB" ;;
        baseline) /usr/bin/time -v -o "$SCRATCH/time.txt" sh -c "head -c $gib /dev/zero | cat >/dev/null" ;;
      esac
      rm -f "$TASKBOX_STATE_DIR"/spill/*
      read -r secs rss code < <(py timev "$SCRATCH/time.txt")
      [ "$code" = 0 ] || die "memory run ($mode) exited $code"
      all_secs+=("$secs") all_rss+=("$rss")
    done
    read -r secs _ < <(py stats "${all_secs[@]}")
    read -r _ rss < <(py stats "${all_rss[@]}")
    local mib gibs
    mib=$(echo "$rss / 1024" | bc -l | xargs printf '%.1f')
    gibs=$(echo "1 / $secs" | bc -l | xargs printf '%.2f')
    eval "mem_${mode}_mib=$mib mem_${mode}_gibs=$gibs mem_${mode}_secs=$secs"
    printf '  %-32s %15s %7s %9s MiB\n' "$mode" "$secs" "$gibs" "$mib"
  done
  local cg
  cg=$(py jsonfield "$SCRATCH/mem.json" resources.max_rss_bytes)
  echo "  (--json run: the ExecResult reports max_rss_bytes=$cg for the sandbox itself)"
  local ok
  for mode in plain json; do
    local m g
    eval "m=\$mem_${mode}_mib g=\$mem_${mode}_gibs"
    ok=$(echo "$m < 64" | bc)
    local label="peak RSS, 1 GiB to stdout"
    [ $mode = json ] && label="$label, --json"
    printf '%s\t%s MiB max RSS; %s GiB/s\t%s\t%s\t%s\t%s\n' "$label" "$m" "$g" \
      "pipe head|cat: $mem_baseline_gibs GiB/s" \
      "$(echo "$g / $mem_baseline_gibs" | bc -l | xargs printf '%.2f')x of pipe throughput" \
      "< 64 MiB" "$([ "$ok" = 1 ] && echo yes || echo '**no**')" >> "$ROWS"
  done
}

# ---- run -------------------------------------------------------------------------------------
command -v bc >/dev/null || apt_install bc || die "bc not found"
[ $want_startup = 1 ] && bench_startup
[ $want_profile = 1 ] && bench_profile
[ $want_diff = 1 ] && bench_diff
[ $want_memory = 1 ] && bench_memory

log "results"
{
  echo "| figure | taskbox | baseline | ratio | target | met |"
  echo "|---|---|---|---|---|---|"
  while IFS=$'\t' read -r a b c d e f; do
    echo "| $a | $b | $c | $d | $e | $f |"
  done < "$ROWS"
} | tee "$SCRATCH/results.md"
if [ -n "${BENCH_OUT:-}" ]; then
  { cat "$SCRATCH/machine.txt"; echo; cat "$SCRATCH/results.md"; } > "$BENCH_OUT"
fi
