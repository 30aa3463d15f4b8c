#!/bin/sh
# Runs test programs and adds up their closing "N passed, M failed" lines; each one's seconds
# follow its output (make test has to stay under 10 minutes on 2 cores).
# A program that crashes or ends without that line counts as one failure; a program named
# "skip:REASON" counts as skipped, or as a failure under STRICT=1 (what CI runs).
passed=0 failed=0 skipped=0
for t in "$@"; do
    case "$t" in
    skip:*)
        echo "skip ${t#skip:}"
        if [ "${STRICT:-0}" = 1 ]; then failed=$((failed + 1)); else skipped=$((skipped + 1)); fi
        continue ;;
    esac
    echo "== $t"
    start=$(date +%s)
    out=$(sh -c "$t" 2>&1); rc=$?
    printf '%s\n' "$out"
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
