"""bench/train_pair_table.py: rounds paired as train_pair.sh ran them, ratios per round."""
import importlib.util
import json
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "train_pair_table.py"


def load():
    spec = importlib.util.spec_from_file_location("train_pair_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(system, config, tps, mib, core=None, **extra):
    r = {"system": system, "config": config, "tokens_per_second": tps, "peak_extra_mib": mib, **extra}
    if core:
        r["openblas_coretype"] = core
    return json.dumps(r)


def test_rounds_pair_in_order_and_each_coretype_apart():
    lines = ["not json: a compiler line"]
    # Three rounds of long, as TORCH_CORETYPE=SkylakeX train_pair.sh prints them.
    for mha, torch, layers, torch_sk, layers_sk, copy in [(12000, 4000, 10000, 6000, 9000, 20.0),
                                                          (9000, 2000, 8000, 4500, 7000, 24.5),
                                                          (10000, 3500, 6000, 5000, 6000, 22.0)]:
        # GFLOP/s a hundredth of tokens/s; mha's runs measured a peak of 250.
        lines += [run("mha", "long", mha, 300.0, gflops=mha / 100, peak_gflops=250.0,
                      percent_of_peak=mha / 100 / 250 * 100, copy_gbs=copy),
                  run("torch", "long", torch, 840.0, "detected", gflops=torch / 100),
                  run("torch+mha-layers", "long", layers, 410.0, "detected", gflops=layers / 100),
                  run("torch", "long", torch_sk, 850.0, "SkylakeX", gflops=torch_sk / 100),
                  run("torch+mha-layers", "long", layers_sk, 420.0, "SkylakeX", gflops=layers_sk / 100)]
    rows = load().table(lines)
    assert len(rows) == 4  # header, rule, one row per OpenBLAS core set
    detected, skylake = rows[2], rows[3]
    # The median of the rounds' ratios (3.00, 4.50, 2.86): not their mean (3.45), not the
    # ratio of the medians (10000 / 3500 = 2.86).
    assert "| 3.00× (3.00, 4.50, 2.86) |" in detected
    assert "| 2.50× (2.50, 4.00, 1.71) |" in detected  # layers: 10000/4000, 8000/2000, 6000/3500
    assert "| 2.00× (2.00, 2.00, 2.00) |" in skylake  # 12000/6000, 9000/4500, 10000/5000
    assert "| 1.50× (1.50, 1.56, 1.20) |" in skylake  # layers: 9000/6000, 7000/4500, 6000/5000
    assert "12.0k, 9000, 10.0k" in detected and "| 20.0–24.5 |" in detected
    # % of the median peak: mha's median 100 GFLOP/s (its runs' own 36–48%), PyTorch's 35
    # and the layers' 80 (detected), 50 and 70 (SkylakeX).
    assert "| 40 (36–48) / 14 / 32% |" in detected and "| 40 (36–48) / 20 / 28% |" in skylake
    assert "300 / 840 / 410" in detected and "300 / 850 / 420" in skylake
