"""bench/lever_table.py: which levers a fidelity row turns on, and which quality-per-bit targets it meets."""

import importlib.util
import json
from pathlib import Path

from qcache.presets import recipe

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
    assert lt._levers({"spec": {"kind": "quant", "bits": None, "options": {"preset": "k3v2"}}})["recent"] == "256"
    assert table[4].endswith("| - |")
    out = tmp_path / "t.md"
    assert lt.main([str(path), "--out", str(out)]) == 0 and "git aaaaaaaaaa (clean tree)" in out.read_text()


def test_resolved_options_win_over_legacy_defaults():
    # a run that recorded its resolved options is read from them; one that did not, with the defaults of its time
    spec = {"kind": "quant", "bits": 3, "options": {}}
    now = lt._levers({"spec": spec, "options": recipe(bits=3).to_dict()})
    then = lt._levers({"spec": spec})
    assert (now["rotation"], now["value scale"], now["key block"], now["window bits"]) == ("hadamard (auto)",
                                                                                          "norm", "128", "8")
    assert (then["rotation"], then["value scale"], then["key block"], then["window bits"]) == ("-", "minmax", "64",
                                                                                             "16")
    sliding = recipe(bits=3, sliding_layers="quantized", sliding_bits=8).to_dict()
    assert lt._levers({"spec": spec, "options": sliding})["sliding"] == "8-bit"


def _needle_row(kind, length, found, thirds):
    from calibration.needles import wilson_interval

    return {"cache": kind, "spec": {"kind": kind}, "length": length, "needles": 30, "found": found,
            "share": found / 30, "wilson95": list(wilson_interval(found, 30)), "bits_per_value": 3.5,
            "by_third": [{"third": i, "needles": 10, "found": k, "wilson95": list(wilson_interval(k, 10))}
                         for i, k in enumerate(thirds)]}


def test_needles_kept():
    ref = _needle_row("default", 8192, 13, (2, 3, 8))
    assert lt.needles_kept(_needle_row("quant", 8192, 12, (1, 3, 8)), ref) == []  # inside the default's interval
    assert lt.needles_kept(_needle_row("quant", 8192, 20, (9, 9, 2)), ref) == [  # more in all, fewer in the last
        "8192 last third: 2/10 < 49 %"]
    assert lt.needles_kept(_needle_row("quant", 8192, 4, (1, 0, 3)), ref) == [
        "8192: 4/30 < 27 %", "8192 middle third: 0/10 < 11 %", "8192 last third: 3/10 < 49 %"]
    run = {"settings": {"needles": 30}, "needles": [ref, _needle_row("quant", 8192, 4, (1, 0, 3))]}
    table = lt._needle_table(run)
    assert table[-2].startswith("| default | 43 (2 / 3 / 8) | 3.50 | (reference) |")
    assert table[-1].startswith("| quant | 13 (1 / 0 / 3) | 3.50 | no: 8192: 4/30 < 27 %")


def test_needle_only_run_has_no_fidelity_table(tmp_path):
    run = {"model": "m", "command": "python -m eval.fidelity --caches", "started": "today",
           "git": {"commit": "b" * 40, "dirty": False}, "settings": {"context": 8192, "docs": 2, "scored_per_doc": 4095,
                                                                   "needles": 30},
           "fidelity": [], "needles": [_needle_row("default", 8192, 13, (2, 3, 8)),
                                        _needle_row("quant", 8192, 12, (1, 3, 8))]}
    path = tmp_path / "needles.json"
    path.write_text(json.dumps(run))
    text = lt.render(path)
    assert "needles only (no fidelity part)" in text and "predictions scored" not in text
    assert "| K/V bits |" not in text and "| quant | 40 (1 / 3 / 8) |" in text


def test_a_recorded_per_layer_plan_is_named_by_its_mean_widths():
    row = _row({"kind": "quant", "bits": None, "options": {"calibration": "plan.safetensors"}}, 3.5, 0.01, 0.2)
    row["options"] = {**{k: v for k, v in lt.LEGACY_DEFAULTS.items()}, "layer_bits": [[4, 2], [3, 3]]}
    assert lt._levers(row)["kv"] == "plan K3.5V2.5"
