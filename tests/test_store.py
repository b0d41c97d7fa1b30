"""qcache.store.PackedStore: declared parts, appended in place with amortized growth, dropped, cropped, batch-mapped,
and counted to the byte."""

import pytest
import torch

from qcache.store import PackedStore, Part


def make(batch=2, heads=3, min_grow=None, bounded=None):
    parts = [Part("codes", "token", (8,), torch.uint8, "packed"),
             Part("scale", "token", (2,), torch.float16, "scales"),
             Part("block_scale", "block", (4,), torch.float32, "scales"),
             Part("res", "residual", (4,), torch.bfloat16, "full_precision")]
    return PackedStore(parts, batch, heads, min_grow=min_grow, bounded=bounded)


def tokens(store, n, start=0):
    """n token entries whose values encode their index, [B, H, n, ...] per part."""
    idx = torch.arange(start, start + n)
    return {"codes": (idx % 251).to(torch.uint8)[None, None, :, None].expand(store.batch, store.heads, n, 8).clone(),
            "scale": idx.to(torch.float16)[None, None, :, None].expand(store.batch, store.heads, n, 2).clone()}


def test_append_writes_in_place_and_grows_rarely():
    store = make(min_grow={"token": 4})
    reallocations = 0
    buffer = None
    for i in range(1000):
        store.append("token", **tokens(store, 3, 3 * i))
        if store._buf["codes"] is not buffer:
            reallocations += 1
            buffer = store._buf["codes"]
    assert store.length("token") == 3000
    assert torch.equal(store.view("scale")[0, 0, :, 0], torch.arange(3000).to(torch.float16))
    assert reallocations < 200  # geometric growth (1/64 more each time), not a reallocation per append
    # capacity stays close to what is used: at most 1/64 + min_grow more
    assert store._capacity["token"] <= 3000 + 3000 // 64 + 4


def test_parts_of_an_axis_append_together():
    store = make()
    with pytest.raises(ValueError, match=r"needs exactly the parts \['codes', 'scale'\]"):
        store.append("token", codes=torch.zeros(2, 3, 1, 8, dtype=torch.uint8))
    bad = tokens(store, 2)
    bad["scale"] = bad["scale"][:, :, :1]
    with pytest.raises(ValueError, match="disagree on the number of entries"):
        store.append("token", **bad)
    with pytest.raises(ValueError, match="axis='pages' is not supported"):
        Part("x", "pages", (1,), torch.uint8, "packed")


def test_drop_front_and_crop_keep_the_right_entries():
    store = make(min_grow={"token": 4})
    store.append("token", **tokens(store, 50))
    store.drop_front("token", 20)
    store.append("token", **tokens(store, 10, 50))
    store.crop("token", 35)
    assert torch.equal(store.view("codes")[1, 2, :, 0], torch.arange(20, 55).to(torch.uint8))
    with pytest.raises(ValueError, match="holds 35 entries"):
        store.crop("token", 36)


def test_a_draining_axis_does_not_hold_its_peak():
    """The residual takes a whole prefill chunk, then drains: its buffer shrinks back near what it holds."""
    store = make(min_grow={"residual": 8})
    store.append("residual", res=torch.ones(2, 3, 4096, 4, dtype=torch.bfloat16))
    store.drop_front("residual", 4096 - 100)
    assert store.length("residual") == 100
    assert store._capacity["residual"] < 200
    assert torch.equal(store.view("res"), torch.ones(2, 3, 100, 4, dtype=torch.bfloat16))


def test_map_batch_applies_to_every_part():
    store = make()
    store.append("token", **tokens(store, 5))
    store.append("block", block_scale=torch.arange(2 * 3 * 2 * 4, dtype=torch.float32).view(2, 3, 2, 4))
    before = {name: t.clone() for name, t in store.views().items()}
    idx = torch.tensor([1, 1, 0])
    store.map_batch(lambda t: t.index_select(0, idx))
    assert store.batch == 3
    for name, t in before.items():
        assert torch.equal(store.view(name), t[idx]), name
    store.append("token", **tokens(store, 2, 5))  # still appendable after the batch changed
    assert store.length("token") == 7


def test_nbytes_counts_every_byte_by_category():
    store = make()
    store.append("token", **tokens(store, 10))
    got = store.nbytes()
    used_packed = 2 * 3 * 10 * 8
    used_scales = 2 * 3 * 10 * 2 * 2
    assert got["packed"] == used_packed and got["scales"] == used_scales
    held = sum(buf.untyped_storage().nbytes() for buf in store._buf.values())
    assert sum(got.values()) == held and got["reserved"] == held - used_packed - used_scales


def test_a_bounded_axis_goes_back_to_its_steady_capacity_after_a_chunk():
    """A prefill chunk of 256 tokens drains to a recent window of 190: the residual's buffer goes back to its steady
    capacity (here 192), not the chunk's peak (which would count as held bytes at every context), and appends up to
    that capacity do not reallocate."""
    store = make(min_grow={"residual": 64}, bounded={"residual": 192})
    store.append("residual", res=torch.ones(2, 3, 256 + 190, 4, dtype=torch.bfloat16))
    assert store._capacity["residual"] > 256 + 190
    store.drop_front("residual", 256)
    assert store.length("residual") == 190
    assert store._capacity["residual"] == 192
    buf = store._buf["res"]
    store.append("residual", res=torch.ones(2, 3, 2, 4, dtype=torch.bfloat16))
    assert store._buf["res"] is buf


def test_bounded_axes_must_be_axes():
    with pytest.raises(ValueError, match="bounded axes \\['tokens'\\]"):
        make(bounded={"tokens": 4})
