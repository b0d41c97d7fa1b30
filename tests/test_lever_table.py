"""bench/lever_table.py: which levers a fidelity row turns on, and which quality-per-bit targets it meets."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("lever_table", ROOT / "bench" / "lever_table.py")
lt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lt)


def _row(spec, bpv, kl, dppl):
    return {"cache": "x", "spec": spec, "bits_per_value": bpv, "kl": kl, "top1": 0.9, "delta_ppl_pct": dppl,
            "ci95": {"kl": [kl * 0.9, kl * 1.1], "delta_ppl_pct": [dppl - 1, dppl + 1]}}


def test_levers_and_targets(tmp_path):
    rows = [
        {"cache": "default", "spec": {"kind": "default", "bits": None, "options": {}}, "bits_per_value": 16.0},
        _row({"kind": "quant", "bits": 3, "options": {"rotation": "hadamard", "rotate": "v", "v_scale": "norm"}},
             3.4, 0.015, 1.0),
        _row({"kind": "quant", "bits": None, "options": {"calibration": "auto", "bits_per_value": 3.4}}, 3.4, 0.015,
             1.0),  # calibrated: does not count for the no-calibration 3.5 row
        _row({"kind": "quant", "bits": 2, "options": {"k_group_size": 128}}, 2.55, 0.08, 7.9),
        _row({"kind": "quant", "bits": 4, "options": {}}, 4.6, 0.001, 0.1),  # over every budget but none
    ]
    run = {"model": "m", "command": "python -m eval.fidelity", "started": "today", "git": {"commit": "a" * 40,
           "dirty": False}, "settings": {"context": 8192, "docs": 1, "scored_per_doc": 4095}, "reference_ppl": 12.5,
           "fidelity": rows}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    table = [line for line in lt.render(path).splitlines() if line.startswith("| ")][1:]
    assert table[0].startswith("| default |") and "PPL 12.500" in table[0]
    assert table[1].startswith("| K3V3 | hadamard (v) | uniform | norm | 64 | 128 | 16 | native | no | 3.40 |")
    assert table[1].endswith("| ≤ 3.5 |")  # KL 0.015 is over the 4.5 row's 0.005
    assert table[2].startswith("| plan ≤ 3.4 |") and table[2].endswith("| - |")
    assert table[3].startswith("| K2V2 | - | uniform | minmax | 128 |") and table[3].endswith("| ≤ 2.6 |")
    assert lt._levers({"kind": "quant", "bits": None, "options": {"preset": "k3v2"}})["recent"] == "256"
    assert table[4].endswith("| - |")
    out = tmp_path / "t.md"
    assert lt.main([str(path), "--out", str(out)]) == 0 and "git aaaaaaaaaa (clean tree)" in out.read_text()
