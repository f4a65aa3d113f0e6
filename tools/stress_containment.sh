#!/usr/bin/env bash
# Containment under load: run the tests that check "nothing a test, a reward call or a worker
# starts outlives it" ROUNDS times in a row while a load forks and allocates beside them, and
# print how many rounds passed. The load is LOAD_PROCS processes, each forking short-lived
# children that touch LOAD_MB MiB, without end, until the rounds are done (then killed, with
# their children: they run in a session of their own).
#
#   tools/stress_containment.sh                 # 20 rounds, 2 load processes of 64 MiB
#   ROUNDS=5 LOAD_PROCS=4 tools/stress_containment.sh
#
# Exit status 0 only if every round passed. Each round's pytest output is kept under
# $OUT_DIR (default: a fresh temporary directory), named round-N.log.
set -u
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-20}
LOAD_PROCS=${LOAD_PROCS:-2}
LOAD_MB=${LOAD_MB:-64}
OUT_DIR=${OUT_DIR:-$(mktemp -d -t areal_stress.XXXXXX)}
mkdir -p "$OUT_DIR"
PY=${PY:-.venv/bin/python}
TESTS=(
  "tests/reward/test_sandbox_attacks.py::test_fork_flood_is_bounded_and_dies_with_the_test"
  "tests/reward/test_sandbox_attacks.py::test_double_fork_setsid_daemon_dies_with_its_test_and_later_tests_are_unaffected"
  "tests/reward/test_custom.py::test_what_a_call_starts_dies_with_it_and_its_prints_are_capped"
  "tests/reward/test_custom.py::test_a_clone_parent_child_and_a_respawning_chain_are_gone_after_close"
  "tests/reward/test_contain.py::test_a_wrapped_process_is_pid_1_and_ending_it_ends_a_respawning_chain"
  "tests/reward/test_pool.py::test_close_leaves_no_processes_and_fails_unfinished_calls"
)

LOAD='
import os, sys, time
mb = int(sys.argv[1])
while True:
    pid = os.fork()
    if pid == 0:
        block = bytearray(mb << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        os._exit(0)
    os.waitpid(pid, 0)
'
load_pids=()
for _ in $(seq "$LOAD_PROCS"); do
  setsid "$PY" -c "$LOAD" "$LOAD_MB" &
  load_pids+=($!)
done
stop_load() {
  for pid in "${load_pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null; done
  wait 2>/dev/null
}
trap stop_load EXIT

passed=0
for round in $(seq "$ROUNDS"); do
  if "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" >"$OUT_DIR/round-$round.log" 2>&1; then
    passed=$((passed + 1))
    echo "round $round: passed"
  else
    echo "round $round: FAILED ($(grep -E '^(FAILED|ERROR)' "$OUT_DIR/round-$round.log" | head -3 | tr '\n' ' '))"
  fi
done
echo "containment under load: $passed of $ROUNDS rounds passed ($LOAD_PROCS load processes forking and touching $LOAD_MB MiB each; logs in $OUT_DIR)"
[ "$passed" -eq "$ROUNDS" ]
