"""tools/gpu_kernel_report.py: the GPU kernel page's tables come from the committed JSON, ratios and verdicts
computed, never copied by hand."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_kernel_report as report  # noqa: E402

from relpos._io import generated_begin, generated_region  # noqa: E402

PAYLOAD = {
    "command": "python benchmarks/gpu_kernel.py --out x", "machine": "test", "lengths": [4096],
    "results": {"4096": {
        "t5_forward": {"sdpa_no_bias": {"ms": 1.0}, "relpos_triton": {"ms": 1.2}, "relpos_sdpa": {"ms": 3.0}},
        "alibi_forward": {"sdpa_no_bias": {"ms": 2.0}, "relpos_triton": {"ms": 3.0}, "hand_flex": {"ms": None}},
    }},
    "route_errors": {"t5/triton": 0.001, "t5/sdpa": 0.002}, "fold_accuracy": {"relpos_triton": 0.01},
    "sweep": {"fwd": {"(64, 64, 4, 3)": 1.5, "(128, 128, 8, 3)": None}, "fwd_offsets": {"(64, 32, 4, 3)": 1.25}},
    "throughput": {"repeat": 10, "length": 4096, "results": {
        "t5_forward": {"sdpa_no_bias": {"ms": 0.5}, "relpos_triton": {"ms": 0.8}}}},
    "profile": {"t5_forward/relpos_triton": {"cuda_us_per_call": 917.7, "cpu_us_per_call": 1.0}},
}


def test_ratios_and_verdicts_follow_the_numbers():
    table = report.headline(PAYLOAD)
    assert "| t5_forward | 4096 | 1.00 | 1.20 | 1.20 | 1.3 (met) | 3.00 | - | - |" in table
    assert "| alibi_forward | 4096 | 2.00 | 3.00 | 1.50 | 1.15 (missed) | - | - | - |" in table
    assert "(128, 128, 8, 3): failed" in report.sweep(PAYLOAD)
    assert "| t5 | 0.0010 | 0.0020 |" in report.errors(PAYLOAD)
    assert "| fwd_offsets | (64, 32, 4, 3): 1.25 |" in report.sweep(PAYLOAD)
    assert "Left out" not in report.sweep(PAYLOAD)
    wrong = {"sweep": {**PAYLOAD["sweep"], "wrong": {"{'fwd': (128, 128, 8, 3)}": 0.9}}}
    assert "Left out, their results differing from the shipped tiles' (relative): {'fwd': (128, 128, 8, 3)} 0.9" in report.sweep(wrong)
    assert "- t5_forward: sdpa_no_bias 0.50 (1.00x), relpos_triton 0.80 (1.60x)" in report.throughput(PAYLOAD)
    assert "| t5_forward/relpos_triton | 918 |" in report.profile(PAYLOAD)
    assert "kernels counted twice" in report.profile(PAYLOAD)  # a run before the kernels' own time was recorded
    new = {"profile": {"t5_forward/relpos_triton": {"kernel_us_per_call": 459.0, "cpu_us_per_call": 1.0}}}
    assert "| t5_forward/relpos_triton | 459 |" in report.profile(new) and "twice" not in report.profile(new)
    assert "not measured" in report.throughput({}) and "not measured" in report.profile({})


def test_the_committed_tables_are_what_the_committed_json_gives():
    out = subprocess.run([sys.executable, str(ROOT / "tools/gpu_kernel_report.py"), str(ROOT / "docs/benchmarks/gpu/kernel.json")],
                         capture_output=True, text=True, check=True).stdout
    page = (ROOT / "docs/benchmarks/gpu/kernel-tables.md").read_text()
    assert generated_region(page, generated_begin("kernel.json")) == out  # the page's generated region, as printed
    payload = json.loads((ROOT / "docs/benchmarks/gpu/kernel.json").read_text())
    ours = payload["results"]["16384"]["t5_forward"]["relpos_triton"]["ms"]
    assert f"{ours:.2f}" in (ROOT / "docs/benchmarks/gpu/kernel.md").read_text()  # the page's headline number
