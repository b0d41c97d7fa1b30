"""calibration.collect: the recording attention is registered only while statistics are collected, and what it
recorded is not kept alive once the statistics are returned."""

import gc
import weakref

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from calibration import collect
from conftest import make_model

REGISTRIES = {"attention": AttentionInterface, "mask": AttentionMaskInterface}


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


def _ids(n=3, length=24):
    return torch.randint(2, 96, (n, length), generator=torch.Generator().manual_seed(0))


def _registered(registry) -> object:
    return registry._global_mapping.get(collect.ATTN_NAME, None)


@pytest.mark.parametrize("registry", sorted(REGISTRIES))
def test_registry_is_clean_afterwards(llama, registry):
    assert _registered(REGISTRIES[registry]) is None
    before = llama.config._attn_implementation
    stats = collect.collect_statistics(llama, _ids(), progress=False)
    assert sorted(stats) == [0, 1] and stats[0]["keys"].shape == (2, 3 * 24, 32)
    assert _registered(REGISTRIES[registry]) is None
    assert llama.config._attn_implementation == before


@pytest.mark.parametrize("registry", sorted(REGISTRIES))
def test_registry_is_clean_after_an_error(llama, registry):
    bad = torch.full((1, 8), 10_000)  # ids beyond the vocabulary: the embedding raises mid-collection
    with pytest.raises(IndexError):
        collect.collect_statistics(llama, bad, progress=False)
    assert _registered(REGISTRIES[registry]) is None


@pytest.mark.parametrize("registry", sorted(REGISTRIES))
def test_an_entry_registered_before_is_put_back(llama, registry):
    def earlier(*args, **kwargs):
        raise AssertionError("not called while collecting")

    REGISTRIES[registry].register(collect.ATTN_NAME, earlier)
    try:
        collect.collect_statistics(llama, _ids(1), progress=False)
        assert _registered(REGISTRIES[registry]) is earlier
    finally:
        REGISTRIES[registry]._global_mapping.pop(collect.ATTN_NAME, None)


def test_recorded_chunks_are_released(llama, monkeypatch):
    """Every K/V chunk the recorder appended is freed once the statistics are returned (and still held)."""
    refs = []
    record = collect._Recorder.__call__

    def recording(self, module, *args, **kwargs):
        out = record(self, module, *args, **kwargs)
        layer = self.layers[module.layer_idx]
        refs.extend(weakref.ref(chunks[-1]) for chunks in (layer.keys, layer.values, layer.k_weight, layer.v_weight))
        return out

    monkeypatch.setattr(collect._Recorder, "__call__", recording)
    stats = collect.collect_statistics(llama, _ids(), progress=False)
    gc.collect()
    assert len(refs) == 3 * 2 * 4  # 3 sequences x 2 layers x 4 tensors
    alive = [ref() for ref in refs if ref() is not None]
    assert not alive, f"{len(alive)} of {len(refs)} recorded chunks are still referenced"
    assert stats[1]["values"].shape == (2, 3 * 24, 32)


def test_stacked_joins_then_empties_the_chunks():
    layer = collect.LayerStats()
    for i in range(2):
        layer.keys.append(torch.full((2, 3, 4), float(i)))  # [H, n, D]
        layer.values.append(torch.full((2, 3, 4), float(i)))
        layer.k_weight.append(torch.full((2, 4), float(i)))  # [H, D]
        layer.v_weight.append(torch.full((2, 3), float(i)))  # [H, n]
    out = layer.stacked()
    assert out["keys"].shape == (2, 6, 4) and out["v_weight"].shape == (2, 6)
    assert torch.equal(out["keys"][:, 3:], torch.ones(2, 3, 4))
    assert torch.equal(out["k_weight"], torch.full((2, 4), 0.5))
    assert layer.keys == [] and layer.values == [] and layer.k_weight == [] and layer.v_weight == []
