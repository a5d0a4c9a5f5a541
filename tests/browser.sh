#!/usr/bin/env bash
# The headless browser tests/test_report.py opens report.html in: Debian's chromium.
#
#   bash tests/browser.sh     install chromium with apt-get when it is missing (root only), print its path
#
# Exit codes: 0 ok (path on stdout), 77 cannot install here (not root / no apt-get): the reason is printed and
# written to $UNAVAILABLE_FILE, and the report test turns it into a skip with that reason (like slurm/dev-cluster.sh).
set -uo pipefail

UNAVAILABLE_FILE="${TMPDIR:-/tmp}/meshrun-browser-unavailable"

found() {
    local b
    for b in chromium chromium-browser; do
        command -v "$b" 2>/dev/null && return 0
    done
    return 1
}

unavailable() {
    echo "browser: chromium UNAVAILABLE: $1; the report's browser test will be SKIPPED" >&2
    echo "$1" >"$UNAVAILABLE_FILE" 2>/dev/null || true
    exit 77
}

if found; then
    rm -f "$UNAVAILABLE_FILE"
    exit 0
fi
[ "$(id -u)" -eq 0 ] || unavailable "chromium is not installed and installing it needs root (apt-get install chromium)"
command -v apt-get >/dev/null || unavailable "chromium is not installed and there is no apt-get to install it"
echo "browser: installing chromium with apt-get: tests/test_report.py renders report.html in it headless" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends chromium >&2 \
    || { apt-get update -q >&2 && apt-get install -y -q --no-install-recommends chromium >&2; } \
    || unavailable "apt-get install chromium failed (see the output above)"
found || unavailable "chromium installed but not on PATH"
rm -f "$UNAVAILABLE_FILE"
