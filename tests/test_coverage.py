"""Model coverage: every decoder family in `bench/coverage_matrix.py` matches DynamicCache at 8 bits, or, where
the family allows a refusal (`Family.refusal`), is refused with a ValueError naming the problem before the cache
stores anything.

The checks are the generator's own (`check_family`: tiny random fp32 model, 48-token prompt, 40 greedy steps,
`QuantCache(bits=8, sink_tokens=4, recent_tokens=16, k_group_size=16)`), so the table in docs/results/coverage.md
states what this file tests. A family that does something else today is marked xfail(strict) with the reason, so
fixing it turns the mark into a failure that asks for the mark's removal.
"""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("coverage_matrix", ROOT / "bench" / "coverage_matrix.py")
cm = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cm  # dataclasses look their module up while the class is built
_spec.loader.exec_module(cm)

# families that fail today, with why (from the traceback of the run that found it); a strict xfail, so fixing one
# turns its mark into a failure that asks for the mark's removal
KNOWN_FAILURES: dict[str, str] = {}  # family key -> why it fails today (strict xfail); none at present


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _params():
    families = {f.key: f for f in cm.FAMILIES}
    assert set(KNOWN_FAILURES) <= set(families)
    for key, family in families.items():
        marks = [pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[key])] if key in KNOWN_FAILURES else []
        yield pytest.param(family, id=key, marks=marks)


def _report(outcome) -> str:
    where = " <- ".join(reversed(outcome.traceback or []))
    return f"{outcome.family} ({outcome.model_type}): {outcome.detail}" + (f"\n  at {where}" if where else "")


@pytest.mark.parametrize("family", list(_params()))
def test_family_matches_dynamic_cache_or_is_refused(family):
    outcome = cm.check_family(family)
    if family.refusal is not None and outcome.kind == "refused":
        assert re.search(family.refusal.pattern, outcome.error), _report(outcome)
        return
    assert outcome.kind == "match", _report(outcome)
    assert outcome.max_dlogit <= cm.LOGIT_TOLERANCE * outcome.logit_std and outcome.quantized_tokens > 0


def test_tolerance_separates_a_cache_that_loses_tokens():
    """The tolerance is tight enough to catch a cache that attends to sinks + recent tokens only at decode."""
    family = next(f for f in cm.FAMILIES if f.key == "llama")
    ratio = cm.lossy_control(family)
    assert ratio > 10 * cm.LOGIT_TOLERANCE, f"a lossy cache moved the logits by only {ratio:.2%} of their std"


def test_table_renders_every_outcome():
    outcomes = [cm.Outcome("llama", "Llama", "llama", "match", "matches DynamicCache at 8 bits (x | y)",
                           lossy_control=0.94),
                cm.Outcome("gpt2", "GPT-2", "gpt2", "refused", "refused: ValueError: no RoPE")]
    text = cm.render_markdown(outcomes, {"command": "python bench/coverage_matrix.py", "date": "today",
                                         "qcache": "0.1.0", "transformers": "5.24.0", "torch": "2.13.0"})
    assert "| Llama | `llama` |  | matches DynamicCache at 8 bits (x \\| y) | 94% |" in text
    assert "| GPT-2 | `gpt2` | learned positions | refused: ValueError: no RoPE |  |" in text
    assert "1 match, 1 refused, 0 failed." in text


def test_summary_groups_families_by_outcome_and_reason():
    outcomes = [cm.Outcome("llama", "Llama", "llama", "match", "matches"),
                cm.Outcome("qwen2", "Qwen2", "qwen2", "match", "matches"),
                cm.Outcome("gpt2", "GPT-2", "gpt2", "refused", "refused",
                           error="ValueError: model_type='gpt2' has no RoPE parameters (config.rope_parameters is None)"),
                cm.Outcome("x", "X", "x", "refused", "refused", error="ValueError: something new; allowed: y"),
                cm.Outcome("y", "Y", "y", "failed", "failed: RuntimeError: boom")]
    lines = cm.summary_markdown(outcomes).splitlines()
    assert lines[2] == "| matches DynamicCache at 8 bits (2) | Llama; Qwen2 |"  # matches first
    assert "| refused: no RoPE (learned positions, ALiBi or none) (1) | GPT-2 |" in lines
    assert "| refused: something new (1) | X |" in lines  # an unknown reason keeps the error's own words
    assert "| FAILED: failed: RuntimeError: boom (1) | Y |" in lines


def test_render_rewrites_markdown_from_json(tmp_path):
    data = {"command": "python bench/coverage_matrix.py", "date": "today", "qcache": "0.1.0",
            "transformers": "5.24.0", "torch": "2.13.0",
            "outcomes": [cm.Outcome("llama", "Llama", "llama", "match", "matches DynamicCache at 8 bits").to_dict()]}
    (tmp_path / "c.json").write_text(__import__("json").dumps(data))
    assert cm.main(["--render", str(tmp_path / "c.json"), "--out", str(tmp_path / "c")]) == 0
    assert "| matches DynamicCache at 8 bits (1) | Llama |" in (tmp_path / "c.md").read_text()
