#!/usr/bin/env bash
# Builds the wheel from a copy of the source (what git tracks, plus new files
# it does not ignore) with `python3 -m build --no-isolation`, installs it into
# a fresh `python3 -m venv --system-site-packages` environment, and from
# outside the tree, without PYTHONPATH, imports mha and runs a forward and a
# backward against PyTorch's own. Prints the wheel's name and size.
# $2: the interpreter to build for (default python3).
set -euo pipefail
src=$1 python=${2:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/src"
(cd "$src" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$tmp/src")
unset PYTHONPATH
cd "$tmp"  # not in the source: its build/ folder would pass for the module `build`
MHA_BUILD_JOBS=${MHA_BUILD_JOBS:-$(nproc)} "$python" -m build --no-isolation --wheel --outdir "$tmp/dist" "$tmp/src" \
  >"$tmp/build.log" 2>&1 || { tail -40 "$tmp/build.log"; exit 1; }
wheel=$(ls "$tmp"/dist/mha-*.whl)
echo "wheel: $(basename "$wheel"), $(stat -c %s "$wheel") bytes"
"$python" -m venv --system-site-packages "$tmp/venv"
"$tmp/venv/bin/pip" install --quiet --no-index --no-build-isolation "$wheel"
"$tmp/venv/bin/python" - "$tmp/venv" <<'PY'
import sys
import numpy as np
import mha
venv = sys.argv[1]
assert mha.__file__.startswith(venv), f"mha came from {mha.__file__}, not the venv {venv}"
import torch
torch.manual_seed(0)
q, k, v = (torch.randn(2, 3, 9, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
out = mha.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
out.square().sum().backward()
grads = [t.grad.clone() for t in (q, k, v)]
for t in (q, k, v):
    t.grad = None
s = (q @ k.transpose(-1, -2)) / 8 ** 0.5
s = s.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
want = torch.softmax(s, -1) @ v
want.square().sum().backward()
assert torch.allclose(out, want, atol=1e-12), "forward"
for g, t in zip(grads, (q, k, v)):
    assert torch.allclose(g, t.grad, atol=1e-12), "backward"
x = np.random.default_rng(1).standard_normal((1, 2, 5, 4)).astype(np.float32)
y = mha.functional.scaled_dot_product_attention(x, x, x)
assert isinstance(y, np.ndarray) and y.shape == (1, 2, 5, 4)
# The whole package came along: the checkpoint loader and the pictures module.
assert callable(mha.load) and callable(mha.viz.heatmaps)
fig = mha.viz.heatmaps(np.full((2, 3, 3), 1 / 3))
assert len([ax for ax in fig.axes if ax.get_title().startswith("layer")]) == 2
print(f"wheel ok: mha {mha.__version__} from {mha.__file__[len(venv):]} in the venv; forward and backward equal torch's")
PY
