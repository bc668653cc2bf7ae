"""mha.load and mha.viz on checkpoints that `mha train --out` writes (the CLI is MHA_CLI).

Checks that the Python model agrees with the C++ tools on the same folder
(`mha generate`, `mha eval`), that forward's logits agree with greedy
decoding, that every attention is a distribution of the right shape and
mask, and that a damaged folder is refused.
"""
import os
import re
import subprocess

import numpy as np
import pytest

import mha

CLI = os.environ.get("MHA_CLI")
pytestmark = pytest.mark.skipif(not CLI, reason="MHA_CLI (the mha program) not set")

SMALL = ["--d-model", "16", "--heads", "2", "--ff", "32", "--heldout", "8", "--eval-every", "0"]
BOS, SEP, EOS = 11, 12, 14


def run(*args):
    return subprocess.run([CLI, *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    paths = {}
    for name, extra in {
        "decoder": ["--task", "reverse", "--layers", "2", "--steps", "60"],
        "encoder-decoder": ["--arch", "encoder-decoder", "--task", "copy", "--layers", "1", "--encoder-layers", "2",
                            "--steps", "30"],
        "encoder": ["--arch", "encoder", "--task", "sort", "--layers", "1", "--steps", "30", "--position", "rope"],
        "linear": ["--attention", "linear", "--task", "copy", "--layers", "1", "--steps", "5"],
        "vision": ["--task", "digits", "--layers", "2", "--steps", "20"],
    }.items():
        paths[name] = str(root / name)
        lengths = [] if name == "vision" else ["--min-length", "2", "--max-length", "5"]
        run("train", *SMALL, *lengths, *extra, "--out", paths[name])
    return paths


def test_decoder_matches_the_cli_and_its_own_forward(runs):
    model = mha.load(runs["decoder"])
    assert isinstance(model, mha.TokenModel)
    assert model.architecture == "decoder" and model.task == "reverse" and model.checksummed
    assert model.config["model"]["num_layers"] == 2 and "reverse" in repr(model)
    for text in ["3 1 4", "9 0 2 6 5"]:
        cli = run("generate", "--checkpoint", runs["decoder"], "--input", text).strip()
        assert model.generate(text) == cli
        # Greedy decoding with the KV cache picks each forward logit's argmax.
        answer = model.answer(text)
        ids = [BOS, *model.tokens(text), SEP, *answer]
        logits = model.forward(ids)
        assert logits.shape == (1, len(ids), 21) and logits.dtype == np.float32
        picks = logits[0, len(ids) - len(answer) - 1:].argmax(-1).tolist()
        assert picks[:len(answer)] == answer
        if len(picks) > len(answer):  # it stopped at EOS, not at the limit
            assert picks[len(answer)] == EOS
        else:
            assert len(answer) == 2 * len(model.tokens(text)) + 2
    # A batch of two rows: each row's logits as alone.
    batch = np.array([[BOS, 3, 1, SEP], [BOS, 4, 4, SEP]])
    both = model.forward(batch)
    np.testing.assert_allclose(both[1], model.forward(batch[1])[0], rtol=1e-5, atol=1e-6)


def test_decoder_attention_is_causal_and_sums_to_one(runs):
    model = mha.load(runs["decoder"])
    maps = model.attention("3 1 4", output="4 1 3")
    assert list(maps) == ["self"]
    a = maps["self"]
    assert a.name == "self-attention"
    assert a.queries == ["<s>", "3", "1", "4", "=", "4", "1", "3"] == a.keys
    assert a.weights.shape == (2, 2, 8, 8)
    np.testing.assert_allclose(a.weights.sum(-1), 1.0, atol=1e-5)
    assert np.all(np.triu(a.weights, k=1) == 0)  # no query sees a later key
    # The model's own answer by default.
    assert len(model.attention("3 1 4")["self"].queries) == 5 + len(model.answer("3 1 4"))


def test_evaluate_matches_mha_eval(runs):
    model = mha.load(runs["decoder"])
    e = model.evaluate()
    out = run("eval", "--checkpoint", runs["decoder"])
    exact = float(re.search(r"exact match ([0-9.]+)%", out).group(1))
    assert e["examples"] == 8 and abs(100 * e["exact_match"] - exact) < 0.06
    longer = model.evaluate(min_length=7, max_length=8)
    assert longer["examples"] == 8 and 0 <= longer["token_accuracy"] <= 1


def test_heads_match_the_cli(runs):
    model = mha.load(runs["decoder"])
    report = model.heads(examples=16, batch=5)
    assert list(report) == ["self"]
    r = report["self"]
    assert r["importance"].shape == (2, 2) and r["positional"].dtype == bool and r["offset"].dtype == np.int64
    np.testing.assert_allclose((r["importance"] ** 2).sum(axis=1), 1.0, rtol=1e-6)
    out = run("heads", "--checkpoint", runs["decoder"], "--examples", "16", "--batch", "5")
    rows = [line.split() for line in out.splitlines() if line.startswith("self")]
    assert len(rows) == 4
    for row in rows:
        layer, head = int(row[1]), int(row[2])
        assert abs(float(row[3]) - r["importance"][layer, head]) < 1e-3
        assert abs(float(row[4]) - r["entropy"][layer, head]) < 1e-3
    ed = mha.load(runs["encoder-decoder"]).heads(examples=8)
    assert list(ed) == ["encoder", "decoder", "cross"] and ed["encoder"]["importance"].shape == (2, 2)
    with pytest.raises(ValueError, match="examples"):
        model.heads(examples=0)


def test_a_pruned_checkpoint(runs, tmp_path):
    """`mha prune`'s output loads: heads by id (the pruned one NaN), attention per layer of the heads left,
    the CLI's answers."""
    out = str(tmp_path / "pruned")
    run("prune", "--checkpoint", runs["decoder"], "--heads", "1", "--out", out)
    model = mha.load(out)
    r = model.heads(examples=8)["self"]
    assert sorted(len(ids) for ids in r["heads"]) == [1, 2]
    gone = [(l, h) for l in range(2) for h in range(2) if h not in r["heads"][l]]
    assert len(gone) == 1 and np.isnan(r["importance"][gone[0]])
    assert r["pattern"][gone[0][0]][gone[0][1]] == "" and len(r["pattern"]) == 2
    assert np.isfinite(np.delete(r["importance"].ravel(), gone[0][0] * 2 + gone[0][1])).all()
    weights = model.attention("3 1 4")["self"].weights  # (layers, nhead, q, k) by id
    assert weights.shape[:2] == (2, 2) and np.isnan(weights[gone[0]]).all()
    assert np.isfinite(np.delete(weights.reshape(4, -1), gone[0][0] * 2 + gone[0][1], axis=0)).all()
    assert model.generate("3 1 4") == run("generate", "--checkpoint", out, "--input", "3 1 4").strip()


def test_encoder_decoder_and_encoder(runs):
    ed = mha.load(runs["encoder-decoder"])
    assert ed.architecture == "encoder-decoder"
    assert ed.generate("5 2") == run("generate", "--checkpoint", runs["encoder-decoder"], "--input", "5 2").strip()
    logits = ed.forward([[5, 2, 7]], target=[[BOS, 5, 2]])
    assert logits.shape == (1, 3, 21)
    with pytest.raises(ValueError, match="target"):
        ed.forward([[5, 2]])
    maps = ed.attention("5 2 7", output="5 2 7")
    assert list(maps) == ["encoder", "decoder", "cross"]
    assert maps["encoder"].weights.shape == (2, 2, 3, 3)
    assert maps["decoder"].weights.shape == (1, 2, 4, 4)
    assert maps["cross"].weights.shape == (1, 2, 4, 3)
    for a in maps.values():
        np.testing.assert_allclose(a.weights.sum(-1), 1.0, atol=1e-5)

    enc = mha.load(runs["encoder"])
    assert enc.architecture == "encoder"
    answer = enc.answer("3 1 4")
    assert len(answer) == 3  # sort: as many slots as the input has digits
    with pytest.raises(ValueError, match="target"):
        enc.forward([BOS, 3, SEP], target=[[1]])
    a = enc.attention("3 1 4")["self"]
    assert a.weights.shape == (1, 2, 8, 8) and a.keys[-1] == "?"  # BOS 3 1 4 SEP and three MASK slots
    assert np.any(np.triu(a.weights[0, 0], k=1) > 0)  # bidirectional


def test_vision_model(runs):
    model = mha.load(runs["vision"])
    assert isinstance(model, mha.VisionModel) and model.architecture == "vision"
    cfg = model.config
    assert cfg["model"]["patch"] == 2 and cfg["steps"] == 20 and 0 <= cfg["heldout_accuracy"] <= 1
    images = np.random.default_rng(0).uniform(0, 16, (3, 8, 8))
    logits = model.forward(images)
    assert logits.shape == (3, 10)
    np.testing.assert_array_equal(model.forward(images.reshape(3, 64)), logits)
    np.testing.assert_allclose(model.forward(images[1])[0], logits[1], rtol=1e-5, atol=1e-5)
    assert model.predict(images).tolist() == logits.argmax(1).tolist()
    a = model.attention(images[0])["self"]
    assert a.weights.shape == (2, 2, 17, 17)  # the class token and 4 x 4 patches
    assert a.queries[0] == "cls" and a.queries[-1] == "3,3"
    np.testing.assert_allclose(a.weights.sum(-1), 1.0, atol=1e-5)
    with pytest.raises(ValueError, match="images"):
        model.forward(np.zeros((2, 7, 7)))
    with pytest.raises(ValueError, match="one image"):
        model.attention(images)
    # The token tools refuse a ViT's folder with a pointer to the right loader.
    refused = subprocess.run([CLI, "eval", "--checkpoint", runs["vision"]], capture_output=True, text=True)
    assert refused.returncode != 0 and "load_vision_checkpoint" in refused.stderr


def test_variants_without_weights_and_damaged_folders(runs, tmp_path):
    linear = mha.load(runs["linear"])
    assert linear.generate("1 2") == run("generate", "--checkpoint", runs["linear"], "--input", "1 2").strip()
    with pytest.raises(mha.ArgumentError, match="linear attention"):
        linear.attention("1 2")
    with pytest.raises(mha.FormatError, match="cannot open"):
        mha.load(tmp_path / "nothing here")
    with pytest.raises(ValueError, match="expected digits"):
        linear.generate("3 x 4")
    # One changed byte in the weights: refused by its checksum, never half-read.
    for name in ("decoder", "vision"):
        damaged = tmp_path / name
        damaged.mkdir()
        for f in ("config.json", "model.safetensors"):
            data = bytearray(open(os.path.join(runs[name], f), "rb").read())
            if f == "model.safetensors":
                data[-9] ^= 0x20
            (damaged / f).write_bytes(bytes(data))
        with pytest.raises(mha.FormatError, match="model.safetensors"):
            mha.load(damaged)


def test_viz_heatmaps(runs, tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    a = mha.load(runs["decoder"]).attention("3 1 4")["self"]
    fig = mha.viz.heatmaps(a)
    assert isinstance(fig, Figure)
    panels = [ax for ax in fig.axes if ax.get_title().startswith("layer")]
    assert [ax.get_title() for ax in panels] == ["layer 0 head 0", "layer 0 head 1", "layer 1 head 0",
                                                 "layer 1 head 1"]
    assert [t.get_text() for t in panels[0].get_xticklabels()] == a.keys
    np.testing.assert_array_equal(panels[3].images[0].get_array(), a.weights[1, 1])
    fig.savefig(tmp_path / "heads.png")
    assert (tmp_path / "heads.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    one = a.plot(layers=[1], heads=[0], annotate=True, title="one head")
    assert len([ax for ax in one.axes if ax.get_title().startswith("layer")]) == 1
    # The whole matrix is drawn: its size is that of the answer the model generated.
    assert mha.viz.heatmaps(a.weights[0, 0]).axes[0].images[0].get_array().shape == a.weights.shape[2:]
    named = mha.viz.heatmaps(a.weights[0], titles=["first", "second"])
    assert [ax.get_title() for ax in named.axes[:2]] == ["first", "second"]
    with pytest.raises(ValueError, match="titles"):
        mha.viz.heatmaps(a.weights[0], titles=["one"])
    with pytest.raises(ValueError, match="heads"):
        mha.viz.heatmaps(a, heads=[2])
    with pytest.raises(ValueError, match="queries"):
        mha.viz.heatmaps(a.weights, queries=["a"])
    with pytest.raises(ValueError, match="attention"):
        mha.viz.heatmaps(np.zeros(3))
    assert matplotlib.__version__
