#!/bin/sh
# ptxas_spills.sh LOG PATTERN - the no-spill rule, from the `nvcc -Xptxas -v` output in LOG.
# One line per kernel whose (demangled) name contains PATTERN, for every architecture: "ok" with
# its registers, or "FAIL" if it spills; then "N passed, M failed" (tests/run.sh adds it up).
log=$1 pattern=$2
demangle() { if command -v c++filt >/dev/null 2>&1; then c++filt; else cat; fi; }
awk '
/Compiling entry function/ { split($0, q, "\047"); name = q[2]; arch = q[4] }
/bytes spill stores/ { stores = $5; loads = $9 }
/Used [0-9]+ registers/ {
    if (name == "") next
    regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
    print name, arch, regs, stores + loads
    name = ""
}' "$log" | while read -r name arch regs spill; do
    printf '%s %s %s %s\n' "$(printf '%s' "$name" | demangle | tr ' ' '_')" "$arch" "$regs" "$spill"
done | awk -v pat="$pattern" '
index($1, pat) {
    if ($4 == 0) { printf "ok   %s %s: %s registers, no spills\n", $2, $1, $3; ok++ }
    else { printf "FAIL %s %s: %s registers, %s bytes of spill traffic\n", $2, $1, $3, $4; bad++ }
}
END {
    if (ok + bad == 0) { print "FAIL no kernel named like \"" pat "\" in the log"; bad = 1 }
    printf "%d passed, %d failed\n", ok, bad
}'
