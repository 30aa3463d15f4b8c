#!/bin/sh
# Runs test programs and adds up their closing "N passed, M failed" lines; each one's seconds
# follow its output (make test has to stay under 10 minutes on 2 cores).
# A program that crashes or ends without that line counts as one failure; a program named
# "skip:REASON" counts as skipped, or as a failure under STRICT=1 (what CI runs). TIMEOUT=N
# stops any one program after N seconds (make test-gpu: a hang costs that program, not the
# programs after it).
passed=0 failed=0 skipped=0
log=$(mktemp)
trap 'rm -f "$log" "$log.rc"' EXIT
for t in "$@"; do
    case "$t" in
    skip:*)
        echo "skip ${t#skip:}"
        if [ "${STRICT:-0}" = 1 ]; then failed=$((failed + 1)); else skipped=$((skipped + 1)); fi
        continue ;;
    esac
    echo "== $t"
    start=$(date +%s)
    # Streamed, not captured: a program killed by a timeout still shows how far it got.
    { ${TIMEOUT:+timeout -k 5 "$TIMEOUT"} sh -c "$t" 2>&1; echo $? > "$log.rc"; } | tee "$log"
    rc=$(cat "$log.rc"); out=$(cat "$log")
    echo "   ($(($(date +%s) - start)) s)"
    line=$(printf '%s\n' "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed' | tail -n 1)
    if [ -n "$line" ]; then
        p=${line%% passed*}; f=${line#*passed, }; f=${f%% failed*}
        passed=$((passed + p)); failed=$((failed + f))
        [ "$rc" -ne 0 ] && [ "$f" -eq 0 ] && { echo "FAIL $t exited $rc"; failed=$((failed + 1)); }
    else
        echo "FAIL $t (exit $rc, no summary line)"; failed=$((failed + 1))
    fi
done
echo
if [ "$skipped" -gt 0 ]; then echo "$passed passed, $failed failed, $skipped skipped"
else echo "$passed passed, $failed failed"; fi
[ "$failed" -eq 0 ]
