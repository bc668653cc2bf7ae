#!/usr/bin/env bash
# `mpirun -np P mha train`: data parallel trains as one process does (the
# loss of every step, P = 2 and 3 with a batch 3 does not divide), so does
# context parallel (--context-parallel 2 on 2 and on 4 ranks), resumes
# with another P, and ends the whole job, with a message and the last
# checkpoint intact, when one rank is killed or fails.
# Usage: cli_distributed.sh MHA WORKDIR (ctest sets Open MPI's environment).
set -euo pipefail
mha=$1
work=$2
source "$(dirname "$0")/cli_helpers.sh"
rm -rf "$work" && mkdir -p "$work" && cd "$work"

common=(train --task copy --min-length 3 --max-length 8 --heldout 32 --d-model 32 --heads 2 --layers 2 --ff 64
  --batch 10 --lr 3e-3 --warmup 5 --seed 4 --eval-every 20 --stop-when-perfect false)
# metrics.csv's losses (step, loss) of two runs agree to 1e-4 at every step.
same_losses() {
  python3 - "$1" "$2" <<'EOF' || fail "losses of $1 and $2 differ"
import csv, sys
def losses(path):
    with open(path) as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
worst = max(abs(a[s] - b[s]) for s in a)
print(f"{sys.argv[1]} against {sys.argv[2]}: {len(a)} steps, largest loss difference {worst:.2g}")
assert worst <= 1e-4, worst
EOF
}

"$mha" "${common[@]}" --steps 40 --out one >one.log
for np in 2 3; do
  mpirun -np $np "$mha" "${common[@]}" --steps 40 --out p$np >p$np.log 2>p$np.err || fail "np $np: $(cat p$np.err)"
  grep -q "data parallel over $np ranks (mpi)" p$np.log || fail "np $np did not say it ran data parallel: $(head -3 p$np.log)"
  same_losses one/metrics.csv p$np/metrics.csv
done
# Context parallel: each sequence over 2 ranks, alone (np 2) and in 2 data-parallel groups (np 4).
for np in 2 4; do
  mpirun -np $np "$mha" "${common[@]}" --steps 40 --context-parallel 2 --out cp$np >cp$np.log 2>cp$np.err ||
    fail "context parallel, np $np: $(cat cp$np.err)"
  grep -q "each sequence spread over 2 ranks" cp$np.log || fail "np $np: $(grep ranks cp$np.log)"
  same_losses one/metrics.csv cp$np/metrics.csv
done
expect_error "a divisor of the communicator's 1 ranks" "${common[@]}" --steps 1 --context-parallel 2
grep -q "each batch of 10 as 4 (the first 1 ranks) or 3 examples per rank" p3.log || fail "np 3: the split of 10: $(grep parallel p3.log)"
[ "$(grep -c 'held-out exact match' p2.log)" = 1 ] || fail "only rank 0 prints: $(cat p2.log)"

# Resume with another P: 2 ranks to step 20, then 3 ranks to 40, as one
# process to 20 and on to 40 (--steps sets the learning-rate schedule).
"$mha" "${common[@]}" --steps 20 --out one_half >/dev/null
"$mha" train --resume one_half --steps 40 --out one_resumed >/dev/null
mpirun -np 2 "$mha" "${common[@]}" --steps 20 --out half >/dev/null
mpirun -np 3 "$mha" train --resume half --steps 40 --out resumed >resumed.log
grep -q "resuming half at step 20" resumed.log || fail "resume: $(head -3 resumed.log)"
same_losses one_resumed/metrics.csv resumed/metrics.csv

# A rank killed mid-run: mpirun ends the job within the timeout, saying so;
# the checkpoint written before is whole (it loads and evaluates).
mpirun -np 2 "$mha" "${common[@]}" --steps 100000 --checkpoint-every 5 --out killed >killed.log 2>killed.err &
job=$!
for _ in $(seq 600); do [ -f killed/train_state.safetensors ] && break; sleep 0.1; done
[ -f killed/train_state.safetensors ] || fail "no checkpoint appeared: $(cat killed.err)"
victim=""
for pid in $(pgrep -P $job); do
  tr '\0' '\n' <"/proc/$pid/environ" | grep -qx "OMPI_COMM_WORLD_RANK=1" && victim=$pid
done
[ -n "$victim" ] || fail "rank 1's process not found among mpirun's children: $(pgrep -P $job)"
kill -9 "$victim"
status=0
timeout 60 tail --pid=$job -f /dev/null || fail "the job did not end within 60 s of a rank's death"
wait $job || status=$?
[ $status -ne 0 ] || fail "mpirun succeeded after a rank was killed"
grep -qiE "exited on signal 9|killed" killed.err || fail "no message about the killed rank: $(cat killed.err)"
"$mha" eval --checkpoint killed >killed_eval.log || fail "the last checkpoint does not load: $(cat killed_eval.log)"
echo "killed rank 1 (pid $victim): mpirun ended with status $status; $(head -c 200 killed_eval.log)"

# An error on the ranks ends every rank with the message (no hang).
if timeout 60 mpirun -np 2 "$mha" train --task digits --steps 1 >digits.log 2>digits.err; then
  fail "digits ran under mpirun -np 2"
fi
grep -q "expected one process" digits.err || fail "digits: $(cat digits.err)"
grep -q "ending every rank of the job" digits.err || fail "digits: no word of ending the job: $(cat digits.err)"
echo "cli distributed passed"
