"""Past one device: Transformers' own ways to spread a model, with QuantCache.

* `device_map` placement: every layer placed explicitly (a dict naming each module: `from_pretrained(device_map=...)`
  and accelerate's `dispatch_model`), one layer offloaded to disk (its weights on "meta" between forwards, moved to
  the execution device by accelerate's hooks), and, where CUDA exists, layers split between a GPU and the CPU. Every
  QuantLayer must hold its store on the device its layer computes on (where its k_proj weights live, or the offload
  hook's execution device), and the model must generate and score exactly as on one device. This machine has only
  a CPU: the split across two real devices runs where CUDA does (and in bench/gpu_check.py).
* Tensor parallelism: `tp_plan="auto"` under `torchrun --nproc_per_node 2` (gloo on CPU), tests/tp_worker.py per
  rank: each rank's QuantCache must hold its local share of the KV heads and generate what one process generates at
  8 bits, or refuse with an error that names the KV heads.
"""

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

from qcache import QuantCache, QuantLayer

import tp_worker

HERE = Path(__file__).resolve().parent
LAYERS = 4
OPTS = tp_worker.CACHE_OPTIONS  # 8 bits, small groups: of 44 tokens, 32 are quantized
CUDA = [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def tiny_config(layers=LAYERS):
    return LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                       initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=None,
                       tie_word_embeddings=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-devices")
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config()).save_pretrained(path)
    return path


def generate(model, cache):
    ids = torch.tensor(tp_worker.PROMPT)
    with torch.no_grad():
        out = model.generate(ids.to(model.device), cache=cache, do_sample=False, max_new_tokens=tp_worker.NEW_TOKENS,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0].cpu(), torch.stack(out.logits).cpu()  # [T], [new tokens, 1, V]


@pytest.fixture(scope="module")
def single_device(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cache = QuantCache(**OPTS)
    tokens, logits = generate(model, cache)
    reference_default = generate(model, DynamicCache(config=model.config))[0]
    return tokens, logits, reference_default, cache


def _placements(devices):
    """Per module: where it lives. Layer i on `devices[i % len(devices)]`; embeddings on the first, head on the
    last."""
    places = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0]}
    places.update({f"model.layers.{i}": devices[i % len(devices)] for i in range(LAYERS)})
    places.update({"model.norm": devices[(LAYERS - 1) % len(devices)], "lm_head": devices[(LAYERS - 1) % len(devices)]})
    return places


PLACEMENTS = {
    # every module named: transformers' from_pretrained with an explicit map
    "from-pretrained-explicit-cpu": ("from_pretrained", ["cpu"]),
    # layer 2's weights offloaded to disk: between forwards they are on "meta"; accelerate's hook loads them onto the
    # execution device for its forward, so its cache must live there, not on "meta"
    "from-pretrained-layer-on-disk": ("from_pretrained", ["cpu", "cpu", "disk", "cpu"]),
    # accelerate's dispatch_model on a model built in memory
    "dispatch-model-explicit-cpu": ("dispatch_model", ["cpu"]),
    # two real devices: half the layers on the GPU, half on the CPU
    "from-pretrained-cuda-and-cpu": ("from_pretrained", [CUDA[0], "cpu"] if CUDA else None),
}


def _place(how, devices, model_dir, tmp_path):
    if how == "from_pretrained":
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device_map=_placements(devices),
                                                    offload_folder=str(tmp_path / "offload")).eval()
    from accelerate import dispatch_model

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return dispatch_model(model, device_map=_placements(devices), main_device=devices[0])


def _execution_device(attn) -> torch.device:
    """Where a layer's attention computes: its offload hook's execution device, else where its k_proj weights live."""
    for module in (attn.k_proj, attn):
        hook = getattr(module, "_hf_hook", None)
        device = getattr(hook, "execution_device", None)
        if device is not None and attn.k_proj.weight.device.type == "meta":
            return torch.device(device)
    return attn.k_proj.weight.device


@pytest.mark.parametrize("case", sorted(PLACEMENTS))
def test_device_map_puts_each_layer_cache_on_its_layer_device(case, model_dir, single_device, tmp_path):
    how, devices = PLACEMENTS[case]
    if devices is None:
        pytest.skip("needs a CUDA device (this machine has none); bench/gpu_check.py runs the same split on a GPU")
    model = _place(how, devices, model_dir, tmp_path)
    cache = QuantCache(**OPTS)
    tokens, logits = generate(model, cache)
    ref_tokens, ref_logits, _, ref_cache = single_device
    layers = [(i, layer) for i, layer in enumerate(cache.layers) if isinstance(layer, QuantLayer)]
    assert len(layers) == LAYERS
    offloaded = 0
    for i, layer in layers:
        attn = model.model.layers[i].self_attn
        where = _execution_device(attn)
        offloaded += attn.k_proj.weight.device.type == "meta"
        assert layer.quantized_length == 32  # the store really holds codes, not only full-precision tokens
        held = {name: t.device for name, t in layer.store.views().items()} | {"first": layer.first.device}
        assert set(held.values()) == {where}, f"layer {i} computes on {where} but its store holds {held}"
    assert offloaded == devices.count("disk")  # the offload case really offloads a layer
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert cache.memory().total == ref_cache.memory().total


def test_single_device_reference_is_not_trivial(single_device):
    """The comparison above can fail: the 8-bit cache holds codes, and generation moves off the prompt's tokens."""
    tokens, _, default_tokens, cache = single_device
    assert all(layer.quantized_length == 32 for layer in cache.layers)
    assert len(set(tokens[len(tp_worker.PROMPT[0]):].tolist())) > 3
    assert torch.equal(tokens, default_tokens)  # 8 bits on this model: the greedy choice of the default cache


# ---------------------------------------------------------------------------------------------------------------
# tensor parallelism
# ---------------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp_run(model_dir, tmp_path_factory):
    """tests/tp_worker.py on 2 ranks under torchrun; the ranks' JSON results."""
    torchrun = shutil.which("torchrun")
    if torchrun is None or not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("tensor parallelism needs torch.distributed with the gloo backend and torchrun; not here")
    out = tmp_path_factory.mktemp("tp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(_free_port()),
                           str(HERE / "tp_worker.py"), str(model_dir), str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    ranks = sorted(out.glob("rank*.json"))
    assert proc.returncode == 0 and len(ranks) == 2, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return [json.loads(p.read_text()) for p in ranks]


def test_tensor_parallel_shards_the_model(tp_run):
    """transformers' tp_plan='auto' runs here (gloo on CPU): 2 ranks, each with half the KV heads' projections,
    and the default cache generates what one process generates."""
    for rank, result in enumerate(tp_run):
        assert (result["rank"], result["world"]) == (rank, 2)
        assert result["weight_type"] == "DTensor"
        assert (result["local_kv_heads"], result["config_kv_heads"]) == (1, 2)


def test_tensor_parallel_default_cache_matches_single_process(tp_run, single_device):
    for result in tp_run:
        assert result["default"] == single_device[2].tolist()


def test_tensor_parallel_quant_cache_holds_local_heads_and_matches_single_process(tp_run, single_device):
    for result in tp_run:
        assert "error" not in result, result.get("error")
        assert result["store_heads"] == [1] * LAYERS  # 2 KV heads / 2 ranks
        assert result["quantized_tokens"] == [32] * LAYERS
        assert result["quant"] == single_device[0].tolist()


def test_a_share_of_the_heads_outside_tensor_parallelism_is_refused():
    """Without a process group, key states holding half of the model's KV heads are not a rank's share: refused,
    naming the heads expected (no silent wrong cache)."""
    cache = QuantCache(tiny_config(1), **OPTS)
    k = torch.zeros(1, 1, 4, 16)  # [B, H / 2, T, D]
    with pytest.raises(ValueError, match=r"2 kv heads"):
        cache.update(k, k, 0, kwargs={"position_ids": torch.arange(4)[None]})

