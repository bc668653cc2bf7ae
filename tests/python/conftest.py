"""Shared helpers for the Python conformance tests (run by ctest with PYTHONPATH=build/python).

Every comparison goes through `compare`, which records the largest relative
error seen and the number of configurations; the session writes them to the
file named by MHA_CONFORMANCE_REPORT (if set) for the docs and closing notes.
"""
import json
import os

import pytest
import torch

_report = {"configurations": 0, "comparisons": 0, "max_relative_error": 0.0, "worst": ""}


def relative_error(actual, expected):
    """‖a − e‖ / ‖e‖, with ‖e‖ floored at 1e-2·sqrt(n) so that an all-zero e (a gradient that
    is exactly 0, say) is compared with an absolute tolerance instead of dividing by 0."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = max(expected.norm().item(), 1e-2 * expected.numel() ** 0.5)
    return (actual - expected).norm().item() / scale


def compare(actual, expected, what, tol=1e-5):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = relative_error(actual, expected)
    _report["comparisons"] += 1
    if tol <= 1e-5 and err > _report["max_relative_error"]:  # bf16 comparisons (looser) not counted
        _report["max_relative_error"], _report["worst"] = err, what
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"
    return err


@pytest.fixture
def configuration():
    """Counts one compared configuration."""
    _report["configurations"] += 1


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("MHA_CONFORMANCE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_report, f, indent=1)
    print(f"\nmha conformance: {_report['configurations']} configurations, {_report['comparisons']} "
          f"tensors compared, largest relative error {_report['max_relative_error']:.3g} ({_report['worst']})")
