#!/usr/bin/env bash
# Builds and runs pxed's fuzz targets (cargo-fuzz + libFuzzer on stable Rust; see README.md).
#
#   fuzz/run.sh [--ci] [--runs N] [TARGET...]
#
# Without --ci each target runs to N executions (default 10,000,000), one process each,
# niced, growing its working corpus in fuzz/work/<target> from the committed seeds in
# fuzz/corpus/<target>. --ci runs each target for CI_SECONDS (default 10) from the seeds
# only. Either way a crash, a timeout or an out-of-memory fails the run; the input is
# left in fuzz/artifacts/<target>/ and the log in fuzz/logs/<target>.log.
#
# Needs: cargo-fuzz (`cargo install cargo-fuzz --locked`) and a C++ compiler (g++ or
# clang) for libfuzzer-sys. RUSTC_BOOTSTRAP=1 lets cargo-fuzz's -Z flags through stable.
set -euo pipefail
cd "$(dirname "$0")"

ALL=(dhcp_decide tftp_request config redfish_json renderers)
ci=0
runs=10000000
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --ci) ci=1 ;;
    --runs) runs=$2; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) targets+=("$1") ;;
  esac
  shift
done
[ ${#targets[@]} -gt 0 ] || targets=("${ALL[@]}")

if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "fuzz: cargo-fuzz is not installed: cargo install cargo-fuzz --locked" >&2
  exit 1
fi
if ! command -v c++ >/dev/null 2>&1 && ! command -v clang++ >/dev/null 2>&1; then
  echo "fuzz: libfuzzer-sys needs a C++ compiler: apt-get install -y g++" >&2
  exit 1
fi

export RUSTC_BOOTSTRAP=1
# No sanitizer: pxed has no unsafe code of its own, and safe Rust's bugs are panics,
# which libFuzzer reports as crashes. Debug assertions on, so integer overflow and
# debug_assert! (dhcproto has some) are crashes too.
FUZZ_FLAGS=(-s none -a)
mkdir -p logs
echo "fuzz: building (log fuzz/logs/build.log)"
if ! nice -n 10 cargo fuzz build "${FUZZ_FLAGS[@]}" > logs/build.log 2>&1; then
  tail -n 40 logs/build.log >&2
  exit 1
fi

max_len() {
  case "$1" in
    dhcp_decide) echo 8192 ;;   # up to 16 datagrams of a session
    tftp_request) echo 1100 ;;  # MAX_REQUEST is 1024
    *) echo 4096 ;;
  esac
}

passed=0 failed=0
for t in "${targets[@]}"; do
  args=(-max_len="$(max_len "$t")" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1)
  dict=""
  case "$t" in
    config) dict=dict/config.dict ;;
    redfish_json) dict=dict/redfish.dict ;;
    tftp_request) dict=dict/tftp.dict ;;
  esac
  [ -n "$dict" ] && args+=(-dict="$dict")
  if [ "$ci" = 1 ]; then
    # Seeds only, nothing written into the tree: a scratch corpus per run.
    work=$(mktemp -d)
    args+=(-max_total_time="${CI_SECONDS:-10}")
  else
    work=work/$t
    mkdir -p "$work"
    args+=(-runs="$runs")
  fi
  echo "fuzz: $t ${args[*]}"
  start=$(date +%s)
  if nice -n 10 cargo fuzz run "${FUZZ_FLAGS[@]}" "$t" "$work" "corpus/$t" -- "${args[@]}" \
       > "logs/$t.log" 2>&1; then
    rc=0
  else
    rc=$?
  fi
  secs=$(( $(date +%s) - start ))
  [ "$ci" = 1 ] && rm -rf "$work"
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "logs/$t.log" | tail -n 1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "logs/$t.log" | tail -n 1)
  cov=$(grep -Eo 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+/[0-9]+[a-zA-Z]*' "logs/$t.log" | tail -n 1 || true)
  if [ "$rc" = 0 ]; then
    passed=$((passed + 1))
    echo "fuzz: $t ok: ${execs:-?} executions, ${speed:-?} exec/s, ${secs}s, ${cov:-?}"
  else
    failed=$((failed + 1))
    echo "fuzz: $t FAILED (exit $rc) after ${secs}s; log fuzz/logs/$t.log:" >&2
    grep -E -A 30 'panicked at|ERROR: libFuzzer|SUMMARY' "logs/$t.log" | head -n 60 >&2 || tail -n 40 "logs/$t.log" >&2
    ls "artifacts/$t" 2>/dev/null | sed 's/^/fuzz: artifact: /' >&2 || true
  fi
done
echo "fuzz: $passed passed, $failed failed"
[ "$failed" = 0 ]
