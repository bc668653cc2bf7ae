# What the CLI test scripts share (sourced; $mha is the program under test).
# fail MESSAGE: the test fails with it.
fail() { echo "FAIL: $*"; exit 1; }
# expect_error "what the message must hold" ARGS...: `mha ARGS...` fails, saying so.
expect_error() {
  local want=$1 out
  shift
  if out=$("$mha" "$@" 2>&1); then fail "mha $* succeeded; expected an error with: $want"; fi
  grep -qF -- "$want" <<<"$out" || fail "mha $*: expected an error with '$want'; got: $out"
}
