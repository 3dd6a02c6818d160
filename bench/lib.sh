# shellcheck shell=bash
# Shared by the bench scripts: sourced after `cd` to the project root.
# Provides need TOOL..., $tmp (removed on exit), pids+=(PID) for processes killed on
# exit, free_tcp / free_udp (a free loopback port), and pg_database NAME (a new
# database on a private PostgreSQL started in $tmp/pg on first use, stopped on exit).

# Fails naming the first missing tool.
need() {
    for t in "$@"; do
        command -v "$t" >/dev/null || { echo "missing: $t (run .ci/install.sh)" >&2; exit 1; }
    done
}

tmp=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    if [ -d "$tmp/pg" ]; then .ci/pg-start --stop "$tmp/pg" 2>/dev/null || true; fi
    rm -rf "$tmp"
}
trap cleanup EXIT

free_tcp() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
free_udp() { python3 -c 'import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Creates database NAME on the private PostgreSQL (started by .ci/pg-start in $tmp/pg
# the first time: Unix socket only, synchronous_commit on) and prints its URL.
pg_database() {
    if [ ! -d "$tmp/pg" ]; then chmod 755 "$tmp"; .ci/pg-start "$tmp/pg" >/dev/null; fi
    psql -X -q -h "$tmp/pg" -U postgres -d postgres -c "CREATE DATABASE $1" >/dev/null
    echo "postgres://postgres@localhost/$1?host=$tmp/pg"
}
