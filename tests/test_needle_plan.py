"""bench/needle_plan.py: a per-layer plan from the needle loss per layer, at the code bits of the uniform start."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("needle_plan", ROOT / "bench" / "needle_plan.py")
needle_plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(needle_plan)

KEYS = [-0.01, -0.02, -0.50, +0.02, -0.15, +0.00, -0.02, -0.05]  # Δ answer log-prob: only layer 2 over 0.2 nats
VALUES = [+0.20, -0.40, +0.01, +0.05, -0.10, +0.10, +0.03, -0.02]


def _table(path, stream, bits, deltas):
    lines = [f"# Needle loss per layer: tiny, {stream} at {bits} bits", "", "| layer | Δ | found |", "|---:|---:|---:|"]
    lines += [f"| {i} | {d:+.3f} | 9/16 |" for i, d in enumerate(deltas)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_keys_over_the_threshold_go_to_8_bits_and_the_cheapest_values_pay(tmp_path, capsys):
    keys, values = _table(tmp_path / "k.md", "keys", 3, KEYS), _table(tmp_path / "v.md", "values", 2, VALUES)
    assert needle_plan.main([str(keys), str(values)]) == 0
    # layer 2's keys 3 -> 8 bits: five value layers go 3 -> 2, those whose 2-bit values lose least (0, 5, 3, 6, 2)
    assert capsys.readouterr().out.strip() == "k3v2+k3v3+k8v2+k3v2+k3v3+k3v2x2+k3v3"
    model, stream, bits, loss = needle_plan.read_table(keys)
    pairs = needle_plan.needle_plan(loss, bits, needle_plan.read_table(values)[3], 2, threshold=0.2)
    assert sum(kb + vb for kb, vb in pairs) == 8 * (3 + 3)  # the code bits of uniform k3v3
    # a lower threshold takes layer 4's keys too: ten bits owed, eight value layers to narrow
    with pytest.raises(ValueError, match=r"10 key bits to pay for but only 8 value layers to narrow"):
        needle_plan.needle_plan(loss, bits, needle_plan.read_table(values)[3], 2, threshold=0.1)


def test_tables_that_are_not_one_models_keys_then_values_are_refused(tmp_path):
    keys, values = _table(tmp_path / "k.md", "keys", 3, KEYS), _table(tmp_path / "v.md", "values", 2, VALUES)
    with pytest.raises(SystemExit):
        needle_plan.main([str(values), str(keys)])
    (tmp_path / "x.md").write_text("# something else\n")
    with pytest.raises(ValueError, match=r"x.md: no '# Needle loss per layer"):
        needle_plan.read_table(tmp_path / "x.md")
    with pytest.raises(ValueError, match=r"the key table has 8 layers and the value table 7"):
        needle_plan.needle_plan([0.0] * 8, 3, [0.0] * 7, 2, 0.2)
