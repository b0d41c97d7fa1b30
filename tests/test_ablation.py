"""bench/ablation.py: the rows of the lever ablation (every option spelled out) and its table."""

import importlib.util
from pathlib import Path

from eval.fidelity import CacheSpec
from eval.options import parse_cache_options
from qcache.presets import recipe
from qcache import QuantCacheConfig

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ablation", ROOT / "bench" / "ablation.py")
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)


def _config(spec: str) -> QuantCacheConfig:
    parsed = CacheSpec.parse(spec)
    bits, options = parse_cache_options(parsed.options)
    options.pop("calibration", None)
    return recipe(bits=parsed.bits if bits is None else bits, **options)


def test_rows_are_valid_and_defaults_row_is_the_defaults():
    rows = ab.plan([3, 2], ["sliding8"])
    assert len(rows) == 2 * (2 + 2 * len(ab.LEVERS) + 1)
    labels = [CacheSpec.parse(r["spec"]).label for r in rows]
    assert len(set(labels)) == len(labels)  # the runner refuses repeated labels
    for r in rows:
        _config(r["spec"])  # every row builds a valid configuration
    for bits in (3, 2):
        defaults = next(r for r in rows if r["bits"] == bits and r["row"] == "defaults")
        assert _config(defaults["spec"]).to_dict() == recipe(bits=bits).to_dict()
        none = next(r for r in rows if r["bits"] == bits and r["row"] == "none")
        d = _config(none["spec"]).to_dict()
        assert (d["rotation"], d["v_scale"], d["k_group_size"], d["window_bits"]) == ("none", "minmax", 64, 16)
    window = next(r for r in rows if r["row"] == "defaults − 8-bit window (16-bit)")
    assert _config(window["spec"]).window_bits == 16 and _config(window["spec"]).v_scale == "norm"


def test_table_ratios_against_the_row_changed():
    rows = ab.plan([3], [])
    fidelity = []
    for i, r in enumerate(rows):
        kl = 0.02 if r["row"] == "none" else 0.01 if r["row"] == "defaults" else 0.005
        fidelity.append({"cache": CacheSpec.parse(r["spec"]).label, "kl": kl, "top1": 0.9, "delta_ppl_pct": 1.0,
                         "bits_per_value": 3.5, "ci95": {"kl": [kl, kl], "delta_ppl_pct": [0.5, 1.5]}})
    fidelity[3] = {"cache": fidelity[3]["cache"], "refused": "ValueError: no"}
    report = {"model": "m", "settings": {"context": 8192, "docs": 1, "scored_per_doc": 4095}, "git": {
        "commit": "b" * 40, "dirty": False}, "command": "python -m eval.fidelity", "ablation_command": "x",
        "reference_ppl": 12.0, "started": "today", "fidelity": fidelity}
    table = ab.render(report, rows).splitlines()
    assert "weights in bfloat16" in table[4] and "started today." in table[4]  # the header's fields filled in
    body = [line for line in table if line.startswith("| ")]
    assert body[1].startswith("| **none** | 3.50 | 0.0200")
    assert body[2].split(" | ")[3] == "0.25"  # 0.005 / 0.02 ('none + ...' against 'none')
    assert "ValueError: no" in body[4]
    defaults = next(i for i, line in enumerate(body) if line.startswith("| **defaults**"))
    assert body[defaults + 1].split(" | ")[3] == "0.50"  # against the defaults' 0.01


def test_data_free_leaves_out_the_calibrated_rows_only():
    full, free = ab.plan([3], ["sliding8"]), ab.plan([3], ["sliding8"], data_free=True)
    assert len(full) - len(free) == 2 and not any("calibration" in r["spec"] for r in free)
    assert {r["row"] for r in full} - {r["row"] for r in free} == {
        "none + calibrated codebooks", "defaults + calibrated key codebooks"}
