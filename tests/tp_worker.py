"""One rank of a tensor-parallel run (`torchrun --nproc_per_node 2 tests/tp_worker.py MODEL_DIR OUT_DIR`), driven by
tests/test_devices.py.

Every rank loads MODEL_DIR with `tp_plan="auto"` (transformers' tensor parallelism; on CPU it starts torch.distributed
with the gloo backend), generates greedily through `QuantCache(bits=8)` and through the default cache, and writes
`OUT_DIR/rank{r}.json`: the tokens, the KV heads every QuantLayer's store holds, the heads of the local k_proj, or
the error the cache raised (type and message) when it refused the run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

PROMPT = [[5, 17, 42, 9, 77, 31, 64, 12, 88, 3, 51, 26, 70, 44, 19, 60, 8, 35, 93, 22]]
NEW_TOKENS = 24
CACHE_OPTIONS = {"bits": 8, "k_group_size": 16, "v_group_size": 16, "v_scale": "minmax", "recent_tokens": 4, "sink_tokens": 2}


def main(model_dir: str, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM, DynamicCache

    from qcache import QuantCache, QuantLayer

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    attn = model.model.layers[0].self_attn
    k_weight = attn.k_proj.weight
    local = k_weight.to_local() if hasattr(k_weight, "to_local") else k_weight
    head_dim = model.config.head_dim
    result = {"rank": rank, "world": world, "local_kv_heads": local.shape[0] // head_dim,
              "config_kv_heads": model.config.num_key_value_heads, "weight_type": type(k_weight).__name__}
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        result["default"] = model.generate(ids, cache=DynamicCache(config=model.config), do_sample=False,
                                           max_new_tokens=NEW_TOKENS)[0].tolist()
        cache = QuantCache(**CACHE_OPTIONS)
        try:
            result["quant"] = model.generate(ids, cache=cache, do_sample=False,
                                             max_new_tokens=NEW_TOKENS)[0].tolist()
            result["store_heads"] = [layer.store.heads for layer in cache.layers if isinstance(layer, QuantLayer)]
            result["quantized_tokens"] = [layer.quantized_length for layer in cache.layers
                                          if isinstance(layer, QuantLayer)]
        except (ValueError, RuntimeError) as err:
            result["error"] = {"type": type(err).__name__, "message": str(err)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
