#!/usr/bin/env bash
# A minimal field deployment on one machine (see project.toml beside this file): provisions the
# project into a temporary folder, checks every site's config, starts the server and two
# devices on loopback for two rounds, then writes `anchorage report` of the server's state folder.
#
#   examples/field/run.sh [WORK_DIR]
#
# The programs come from $PATH, or from $ANCHORAGE, $ANCHORAGE_SERVER and $ANCHORAGE_CLIENT
# (e.g. target/release/anchorage after `cargo build --release`); $PORT is the UDP port (47433).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
anchorage="${ANCHORAGE:-anchorage}"
server_bin="${ANCHORAGE_SERVER:-anchorage-server}"
client_bin="${ANCHORAGE_CLIENT:-anchorage-client}"
port="${PORT:-47433}"
work="${1:-$(mktemp -d "${TMPDIR:-/tmp}/anchorage-field.XXXXXX")}"
mkdir -p "$work"
work="$(cd "$work" && pwd)"

# Keys are made here, in the work folder, never in the checkout.
sed "s/:47433\"/:$port\"/" "$here/project.toml" > "$work/project.toml"
"$anchorage" provision "$work/project.toml"
sites="$work/sites"

# Every config and every file it names, without starting anything.
"$server_bin" check-config --config "$sites/server/server.toml"
for device in edge-001 edge-002; do
  "$client_bin" check-config --config "$sites/$device/client.toml"
done

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

"$server_bin" --config "$sites/server/server.toml" 2> "$work/server.log" &
server=$!
pids+=("$server")
for device in edge-001 edge-002; do
  "$client_bin" --config "$sites/$device/client.toml" 2> "$work/$device.log" &
  pids+=("$!")
done

# The server stops by itself after its last round; two minutes is far beyond two rounds.
for _ in $(seq 1 600); do
  kill -0 "$server" 2>/dev/null || break
  sleep 0.2
done
if kill -0 "$server" 2>/dev/null; then
  echo "the server is still running after 2 minutes; its log:" >&2
  tail -n 20 "$work/server.log" >&2
  exit 1
fi
wait "$server" || { echo "the server failed; its log:" >&2; tail -n 20 "$work/server.log" >&2; exit 1; }
for pid in "${pids[@]:1}"; do
  wait "$pid" || { echo "a device failed; see $work/edge-*.log" >&2; exit 1; }
done
grep "round closed" "$work/server.log" || true

"$anchorage" report "$sites/server/state" --out "$work/report"
echo "field example done: report in $work/report/report.md, logs in $work"
