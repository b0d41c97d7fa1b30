"""qcache.check: the smoke test a user runs after installing (tiny random models, no downloads)."""

import dataclasses
import logging

import pytest

from qcache import check
from qcache._compat import TESTED_MINORS, binding_context, binding_report, check_transformers


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_every_smoke_family_is_as_expected_on_the_installed_transformers(capsys):
    assert check.main(["--steps", "6"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == binding_report()
    rows = {line.split()[0] for line in out[1:-1]}
    assert len(out) == len(check.SMOKE_FAMILIES) + 2
    assert {"Llama", "Qwen2", "GPT-2"} <= rows
    llama = next(line for line in out if line.startswith("Llama"))
    assert llama.split()[1] == "ok" and "6/6 tokens equal" in llama
    gpt2 = next(line for line in out if line.startswith("GPT-2"))
    assert gpt2.split()[1] == "refused" and "no RoPE parameters" in gpt2
    assert out[-1].startswith("all families as expected")


def test_a_family_that_must_match_and_is_refused_fails_the_check(monkeypatch, capsys):
    must_match = dataclasses.replace(next(f for f in check.SMOKE_FAMILIES if f.key == "gpt2"), refusal=None)
    monkeypatch.setattr(check, "SMOKE_FAMILIES", (must_match,))
    assert check.main(["--steps", "2"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("1 unexpected")


def test_a_cache_that_differs_is_a_failure(monkeypatch):
    """A QuantCache whose reads are off by far more than 8-bit noise is reported as failed, with the numbers."""
    from qcache.layers import BlockLayer

    update = BlockLayer.update

    def noisy(self, key_states, value_states, *args, **kwargs):
        keys, values = update(self, key_states, value_states, *args, **kwargs)
        return keys, values * 3.0

    monkeypatch.setattr(BlockLayer, "update", noisy)
    outcome, run = check.check_family(check.SMOKE_FAMILIES[0], steps=6)
    assert outcome.kind == "failed" and run is None and "differs from DynamicCache" in outcome.detail


def test_steps_must_be_positive():
    with pytest.raises(SystemExit):
        check.main(["--steps", "0"])


def test_binding_report_names_the_versions():
    import transformers

    line = binding_report()
    assert f"transformers {transformers.__version__}" in line and "kernels " in line and "torch " in line


def test_a_newer_minor_than_ci_tests_is_run_with_a_warning(caplog):
    newer = f"{TESTED_MINORS[-1][0]}.{TESTED_MINORS[-1][1] + 1}.0"
    with caplog.at_level(logging.WARNING, logger="qcache._compat"):
        assert check_transformers(newer) == newer
    assert f"found {newer}" in caplog.text and "python -m qcache.check" in caplog.text


def test_binding_errors_name_the_installed_release():
    import transformers

    assert binding_context().startswith(f"transformers {transformers.__version__}, qcache tested with")
