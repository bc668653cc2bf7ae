#!/usr/bin/env bash
# `mha distill`: a student from a teacher with every term on, resumed; an
# encoder teacher; what reads the student; the bad input it refuses:
# cli_distill.sh MHA DIR.
set -euo pipefail
mha=$1 dir=$2
rm -rf "$dir" && mkdir -p "$dir"
source "$(dirname "${BASH_SOURCE[0]}")/cli_helpers.sh"
small=(--min-length 2 --max-length 4 --eval-every 0 --heldout 16)
student=(--d-model 8 --heads 2 --layers 1 --ff 16 --eval-every 5)
"$mha" train --task copy "${small[@]}" --steps 40 --d-model 16 --heads 4 --layers 2 --ff 32 --out "$dir/teacher" >/dev/null
"$mha" train --task reverse "${small[@]}" --steps 5 --d-model 16 --heads 2 --layers 1 --ff 32 --out "$dir/other" >/dev/null
"$mha" train --task copy "${small[@]}" --steps 5 --d-model 16 --heads 2 --layers 1 --ff 32 --out "$dir/another" >/dev/null

"$mha" distill --teacher "$dir/teacher" "${student[@]}" --steps 10 --temperature 3 --alpha 0.7 --attention-transfer \
  --hidden-transfer --hidden-weight 0.5 --checkpoint-every 5 --out "$dir/student" >"$dir/student.log"
grep -q "mha distill: task copy" "$dir/student.log" || fail "the student trains on the teacher's task: $(cat "$dir/student.log")"
grep -qE "student 0\.[0-9]+x its parameters; temperature 3, alpha 0.7, attention transfer x1, hidden transfer x0.5" \
  "$dir/student.log" || fail "the settings line: $(cat "$dir/student.log")"
for f in model.safetensors config.json train_state.safetensors metrics.csv summary.json distill.json distill.safetensors; do
  [ -f "$dir/student/$f" ] || fail "no $f"
done
python3 - "$dir/student" <<'PY' || fail "distill.json / config.json"
import json, sys
d = json.load(open(sys.argv[1] + "/distill.json"))
assert d["temperature"] == 3 and d["alpha"] == 0.7 and d["attention_weight"] == 1 and d["hidden_weight"] == 0.5, d
m = json.load(open(sys.argv[1] + "/config.json"))["model"]
assert m["d_model"] == 8 and m["nhead"] == 2 and m["num_layers"] == 1, m
PY
"$mha" eval --checkpoint "$dir/student" >/dev/null || fail "eval of the student"
"$mha" distill --teacher "$dir/teacher" --steps 15 --resume "$dir/student" --out "$dir/student" >"$dir/resume.log"
grep -q "resuming .* at step 10" "$dir/resume.log" || fail "resume: $(cat "$dir/resume.log")"
grep -q "after 15 steps" "$dir/resume.log" || fail "resume to 15 steps: $(cat "$dir/resume.log")"

# An encoder teacher teaches an encoder student (the architecture is the teacher's).
"$mha" train --task sort --arch encoder "${small[@]}" --steps 5 --d-model 16 --heads 2 --layers 1 --ff 32 \
  --out "$dir/encoder" >/dev/null
"$mha" distill --teacher "$dir/encoder" "${student[@]}" --steps 3 --attention-transfer --out "$dir/encoder-student" \
  >"$dir/encoder.log"
grep -q "encoder, 1 layers" "$dir/encoder.log" || fail "an encoder student: $(cat "$dir/encoder.log")"

"$mha" train --task copy --arch encoder-decoder "${small[@]}" --steps 2 --d-model 16 --heads 2 --layers 1 --ff 32 \
  --out "$dir/seq2seq" >/dev/null
expect_error "student: expected a decoder-only or encoder model; got encoder-decoder" distill --teacher "$dir/seq2seq" \
  "${student[@]}" --steps 1 --out "$dir/x"
expect_error "teacher: expected one trained on the student's task (copy" distill --teacher "$dir/other" --steps 20 \
  --resume "$dir/student" --out "$dir/student"
expect_error "--teacher: expected the teacher the run started with" distill --teacher "$dir/another" --steps 20 \
  --resume "$dir/student" --out "$dir/student"
expect_error "temperature: expected finite and > 0; got 0" distill --teacher "$dir/teacher" --temperature 0 --out "$dir/x"
expect_error "alpha: expected in [0, 1]; got 1.5" distill --teacher "$dir/teacher" --alpha 1.5 --out "$dir/x"
expect_error "--teacher is required" distill --out "$dir/x"
[ ! -e "$dir/x" ] || fail "a refused distillation wrote $dir/x"
echo "cli distill passed"
