#!/usr/bin/env bash
# `mha train --heads` per layer, `mha prune` (by importance, iteratively, at
# random, down to a layer without heads, an encoder-decoder), what reads a
# pruned checkpoint (eval, generate, heads with its picture and page, viz)
# and the bad input each refuses: cli_pruning.sh MHA DIR.
set -euo pipefail
mha=$1 dir=$2
rm -rf "$dir" && mkdir -p "$dir"
source "$(dirname "${BASH_SOURCE[0]}")/cli_helpers.sh"
small=(--task copy --min-length 2 --max-length 4 --steps 30 --eval-every 0 --d-model 16 --layers 2 --ff 32 --heldout 16)

"$mha" train "${small[@]}" --heads 4,2 --out "$dir/d42" >"$dir/d42.log"
grep -q "heads 4,2 per layer" "$dir/d42.log" || fail "train --heads 4,2: $(cat "$dir/d42.log")"
python3 - "$dir/d42/config.json" <<'PY' || fail "config.json heads"
import json, sys
m = json.load(open(sys.argv[1]))["model"]
assert m["nhead"] == 4 and m["heads"] == [[0, 1, 2, 3], [0, 1]], m
PY

# Half of the 6 heads by importance in 2 rounds, fine-tuned; the report and what reads the result.
"$mha" prune --checkpoint "$dir/d42" --fraction 0.5 --iterations 2 --finetune-steps 5 --examples 16 --batch 8 \
  --out "$dir/half" >"$dir/half.log"
grep -q "3 of 6 heads pruned by importance" "$dir/half.log" || fail "prune --fraction 0.5: $(cat "$dir/half.log")"
grep -q "fine-tuned 5 steps" "$dir/half.log" || fail "fine-tuning"
grep -qE "forward [0-9.]+ ms \([0-9.]+x the unpruned" "$dir/half.log" || fail "forward time"
python3 - "$dir/half" <<'PY' || fail "prune.json / config.json"
import json, sys
d = sys.argv[1]
p = json.load(open(d + "/prune.json"))
assert len(p["pruned"]) == 3 and {h["iteration"] for h in p["pruned"]} == {1, 2}, p
assert p["parameters"]["after"] < p["parameters"]["before"], p
heads = json.load(open(d + "/config.json"))["model"]["heads"]
assert sum(len(l) for l in heads) == 3, heads
for h in p["pruned"]:
    assert h["head"] not in heads[h["layer"]], (h, heads)
PY
"$mha" eval --checkpoint "$dir/half" >"$dir/eval.log"
grep -q "held-out exact match" "$dir/eval.log" || fail "eval of the pruned checkpoint"
"$mha" generate --checkpoint "$dir/half" --input "3 1 4" >/dev/null || fail "generate"
"$mha" heads --checkpoint "$dir/half" --examples 8 --out "$dir/half/heads.png" --html "$dir/half/heads.html" \
  >"$dir/heads.log" || fail "heads of the pruned model"
[ "$(grep -cE '^self +[01] +[0-3] ' "$dir/heads.log")" -eq 3 ] || fail "heads: 3 rows expected: $(cat "$dir/heads.log")"
grep -q '"importance":\[\[' "$dir/half/heads.html" || fail "the page holds the importances"
grep -q '"present":\[\[' "$dir/half/heads.html" || fail "the page says which heads remain"
"$mha" viz --checkpoint "$dir/half" --input "3 1 4" --out "$dir/half/viz.png" >/dev/null || fail "viz"

# Every head pruned at random: layers without heads still evaluate and decode.
"$mha" prune --checkpoint "$dir/d42" --heads 6 --by random --examples 16 --out "$dir/none" >"$dir/none.log"
grep -q "6 of 6 heads pruned at random" "$dir/none.log" || fail "prune --heads 6: $(cat "$dir/none.log")"
"$mha" eval --checkpoint "$dir/none" >/dev/null || fail "eval without heads"
"$mha" generate --checkpoint "$dir/none" --input "3 1" >/dev/null || fail "generate without heads"

# An encoder-decoder: encoder, decoder and cross-attention heads ranked together.
"$mha" train "${small[@]}" --arch encoder-decoder --heads 2 --out "$dir/ed" >/dev/null
"$mha" prune --checkpoint "$dir/ed" --fraction 0.5 --examples 16 --out "$dir/ed-half" >"$dir/ed.log"
grep -q "6 of 12 heads pruned" "$dir/ed.log" || fail "encoder-decoder: $(cat "$dir/ed.log")"
"$mha" eval --checkpoint "$dir/ed-half" >/dev/null || fail "eval of the pruned encoder-decoder"

expect_error "--fraction: expected a share in [0, 1); got 1" prune --checkpoint "$dir/d42" --fraction 1 --out "$dir/x"
expect_error "expected at most the model's 6 heads; got 7" prune --checkpoint "$dir/d42" --heads 7 --out "$dir/x"
expect_error "--fraction, --heads: expected one of them; got both" prune --checkpoint "$dir/d42" --fraction 0.5 \
  --heads 1 --out "$dir/x"
expect_error "expected one of them; got neither" prune --checkpoint "$dir/d42" --out "$dir/x"
expect_error "--by: expected importance or random; got 'loss'" prune --checkpoint "$dir/d42" --heads 1 --by loss --out "$dir/x"
expect_error "--iterations: expected >= 1; got 0" prune --checkpoint "$dir/d42" --heads 1 --iterations 0 --out "$dir/x"
expect_error "--heads: expected one count for every layer or one per layer (2)" train "${small[@]}" --heads 4,2,1
expect_error "got '4,x'" train "${small[@]}" --heads 4,x
expect_error "got '0'" train "${small[@]}" --heads 0
[ ! -e "$dir/x" ] || fail "a refused prune wrote $dir/x"
echo "cli pruning passed"
