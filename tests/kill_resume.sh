#!/usr/bin/env bash
# Training killed with SIGKILL at random moments, then resumed, ends with
# weights bit-identical to an uninterrupted run: kill_resume.sh MHA DIR [ROUNDS].
set -euo pipefail
mha=$1 dir=$2 rounds=${3:-5}
rm -rf "$dir" && mkdir -p "$dir"
# Dropout on, so that the dropout generators must be restored too.
args=(train --task copy --min-length 2 --max-length 6 --steps 3000 --eval-every 0 --d-model 16 --heads 2 --layers 2
      --ff 32 --dropout 0.1 --seed 3 --checkpoint-every 7)
"$mha" "${args[@]}" --out "$dir/straight" >/dev/null
# Each round: start (or resume), kill -9 at a random moment between 0.3 and 1.5 s.
RANDOM=11
killed=0
for round in $(seq 1 "$rounds"); do
  step=$(grep -o '"steps": [0-9]*' "$dir/killed/config.json" 2>/dev/null | grep -o '[0-9]*$' || echo 0)
  if [ -f "$dir/killed/train_state.safetensors" ]; then
    "$mha" "${args[@]}" --resume "$dir/killed" --out "$dir/killed" >"$dir/round$round.log" 2>&1 &
  else
    "$mha" "${args[@]}" --out "$dir/killed" >"$dir/round$round.log" 2>&1 &
  fi
  pid=$!
  ms=$((300 + RANDOM % 1200))
  sleep "$((ms / 1000)).$(printf '%03d' $((ms % 1000)))"
  if kill -9 "$pid" 2>/dev/null; then killed=$((killed + 1)); fi
  wait "$pid" 2>/dev/null || true
  echo "round $round: from the checkpoint at step $step, killed after $ms ms"
done
[ "$killed" -eq "$rounds" ] || { echo "only $killed of $rounds runs were still running when killed: lengthen the run"; exit 1; }
if [ -f "$dir/killed/train_state.safetensors" ]; then
  "$mha" "${args[@]}" --resume "$dir/killed" --out "$dir/killed" >"$dir/final.log"
else
  "$mha" "${args[@]}" --out "$dir/killed" >"$dir/final.log"
fi
# The tensors' bytes (not the metadata: each save has its own id).
python3 - "$dir/straight/model.safetensors" "$dir/killed/model.safetensors" <<'PY'
import json, struct, sys
def tensors(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    return {k: data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
assert a.keys() == b.keys(), "different tensors"
differ = [k for k in a if a[k] != b[k]]
if differ:
    sys.exit("weights differ from the uninterrupted run: " + ", ".join(differ))
print(f"kill test: {len(a)} tensors bit-identical to the uninterrupted run")
PY
echo "kill test passed: $rounds of $rounds rounds killed with SIGKILL and resumed"
