# shellcheck shell=bash
# Shared by the bench scripts: sourced after `cd` to the project root.
# Provides need TOOL..., $tmp (removed on exit), pids+=(PID) for processes killed on
# exit, and free_tcp / free_udp (a free loopback port).

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
    rm -rf "$tmp"
}
trap cleanup EXIT

free_tcp() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
free_udp() { python3 -c 'import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
