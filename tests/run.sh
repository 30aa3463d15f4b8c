#!/bin/sh
# Runs test programs and adds up their closing "N passed, M failed" lines; each one's seconds
# follow its output (make test has to stay under 10 minutes on 2 cores).
# A program that crashes or ends without that line counts as one failure; a program named
# "skip:REASON" counts as skipped, or as a failure under STRICT=1 (what CI runs). TIMEOUT=N
# stops any one program after N seconds (make test-gpu: a hang costs that program, not the
# programs after it). JOBS=N runs N programs at a time (make test: one per core, though an
# emulated kernel test keeps about one and a half busy); their outputs still come whole and in
# order, the first unfinished one's as it is written.
passed=0 failed=0 skipped=0
jobs=${JOBS:-1}
[ "$jobs" -ge 1 ] 2>/dev/null || jobs=1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

# Starts program number $1 of the arguments after it in the background: its output goes to
# $dir/$1.out, and its exit status and seconds to $dir/$1.end when it ends.
start() {
    eval "t=\${$(($1 + 2))}"
    case "$t" in skip:*) echo 0 0 > "$dir/$1.end"; return ;; esac
    (
        s=$(date +%s)
        ${TIMEOUT:+timeout -k 5 "$TIMEOUT"} sh -c "$t" > "$dir/$1.out" 2>&1
        rc=$?
        echo "$rc $(($(date +%s) - s))" > "$dir/$1.tmp" && mv "$dir/$1.tmp" "$dir/$1.end"
    ) &
}

# Prints what program $1 has written since the last call (shown bytes in $shown).
show() {
    [ -f "$dir/$1.out" ] || return 0
    size=$(wc -c < "$dir/$1.out")
    [ "$size" -gt "$shown" ] && head -c "$size" "$dir/$1.out" | tail -c +$((shown + 1))
    shown=$size
}

# Adds program $1's result to the tally (its output is shown by then).
tally() {
    eval "t=\${$(($1 + 2))}"
    read -r rc secs < "$dir/$1.end"
    case "$t" in
    skip:*)
        echo "skip ${t#skip:}"
        if [ "${STRICT:-0}" = 1 ]; then failed=$((failed + 1)); else skipped=$((skipped + 1)); fi
        return ;;
    esac
    echo "   ($secs s)"
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$dir/$1.out" | tail -n 1)
    if [ -n "$line" ]; then
        p=${line%% passed*}; f=${line#*passed, }; f=${f%% failed*}
        passed=$((passed + p)); failed=$((failed + f))
        [ "$rc" -ne 0 ] && [ "$f" -eq 0 ] && { echo "FAIL $t exited $rc"; failed=$((failed + 1)); }
    else
        echo "FAIL $t (exit $rc, no summary line)"; failed=$((failed + 1))
    fi
}

n=$# started=0 next=0 shown=-1
while [ "$next" -lt "$n" ]; do
    ended=$(find "$dir" -name '*.end' | wc -l)
    while [ "$started" -lt "$n" ] && [ $((started - ended)) -lt "$jobs" ]; do
        start "$started" "$@"
        started=$((started + 1))
    done
    eval "t=\${$((next + 1))}"
    if [ "$shown" -lt 0 ]; then
        case "$t" in skip:*) ;; *) echo "== $t" ;; esac
        shown=0
    fi
    # Whether it is done, asked before show: its .end file comes after its last output.
    finished=0
    [ -f "$dir/$next.end" ] && finished=1
    show "$next"
    if [ "$finished" = 1 ]; then
        tally "$next" "$@"
        next=$((next + 1)) shown=-1
    else
        sleep 0.2
    fi
done
echo
if [ "$skipped" -gt 0 ]; then echo "$passed passed, $failed failed, $skipped skipped"
else echo "$passed passed, $failed failed"; fi
[ "$failed" -eq 0 ]
