"""The calibration command (`python -m qcache.calibrate`, the entry point is qcache/calibrate.py): learn what QuantCache needs from real text and save it (safetensors).

    python -m qcache.calibrate --model smollm2-135m --out smollm2.qcache.safetensors
    python -m qcache.calibrate --model gemma3-270m --bits 2 --out gemma3-2bit.qcache.safetensors
    python -m qcache.calibrate --model ./my-hf-dir --data my_text.jsonl --samples 32 --seq-len 1024 --out x.safetensors
    python -m qcache.calibrate --model smollm2-135m --save-dir out/smollm2-qcache-4bit --quality eval.md
    python -m qcache.calibrate --model smollm2-135m --push-to-hub org/smollm2-qcache-4bit
    python -m qcache.calibrate --model smollm2-135m --bits-per-value 3.5 --out plan.safetensors   # per-layer widths

`--bits-per-value B` also chooses one (k_bits, v_bits) per layer within B bits/value at `--context` tokens
(calibration/budget.py: each layer's keys and values measured at 2, 3 and 4 bits on `--sensitivity-samples`
sequences of `--sensitivity-len` tokens, then a greedy allocation) and stores them as the file's `layer_bits`.
`--option NAME=VALUE` sets any other QuantCacheConfig option stored with the file (and used for the measurement);
`--cache quant:3:rotate=v,recent_tokens=64` gives the cache in the spec syntax of eval and bench instead.
With a rotation (the default: values rotated) and no `--option rotate=`, the calibration also measures whether this
model's keys should be rotated too (`rotate="kv"`, also on Lloyd-Max levels: KL on held-in text for each, on
`--rotation-samples` sequences of `--rotation-len` tokens, by default the model's maximum context: `--choose-rotation`)
and stores the best. The file's key codebooks apply where keys stay unrotated.

Default data: dataset_build's English prose, the part evaluation never reads (qcache.tools.data "calibration" split).
`--save-dir` writes a folder laid out like a hub repo (the file + a README.md model card naming the model, the
settings, the data and its sha256, and the measured quality given with `--quality`); `--push-to-hub` uploads
that folder through huggingface_hub (refused under HF_HUB_OFFLINE=1). Load it with
`QuantCache.from_calibration("<dir or org/name>")`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from qcache.calibfile import save_calibration
from qcache.config import SUPPORTED_BITS, QuantCacheConfig
from qcache.presets import recipe

__all__ = ["read_text", "sample_sequences", "max_context", "calibrate_model", "save_calibration", "main"]

log = logging.getLogger(__name__)


def read_text(path: Path) -> str:
    """A .txt file, or a .jsonl file whose lines carry a "text" field."""
    if not path.is_file():
        raise ValueError(f"--data {str(path)!r} does not exist")
    if path.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                record = json.loads(line)
                if "text" not in record:
                    raise ValueError(f"--data {path}: line {n} has no 'text' field (keys: {sorted(record)})")
                texts.append(record["text"])
        return "\n\n".join(texts)
    return path.read_text()


def sample_sequences(tokenizer, text: str, samples: int, seq_len: int, seed: int,
                     flags: str = "--samples/--seq-len") -> torch.Tensor:
    """`samples` windows of `seq_len` tokens, chosen (seeded) among the non-overlapping windows of the text.

    `flags` names the options the counts came from, for the error when the text is too short."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    windows = ids.numel() // seq_len
    if windows < samples:
        raise ValueError(f"the calibration text has {ids.numel()} tokens: {windows} windows of {seq_len}, "
                         f"fewer than the {samples} asked for ({flags}; shorten them or give a longer --data)")
    pick = torch.randperm(windows, generator=torch.Generator().manual_seed(seed))[:samples].sort().values
    return torch.stack([ids[i * seq_len:(i + 1) * seq_len] for i in pick.tolist()])


def max_context(model, flag: str) -> int:
    """The model's maximum context (`max_position_embeddings` of its text config); a ValueError naming `flag` (the
    option that sets the length instead) when the config has none."""
    value = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if value is None:
        raise ValueError(f"the model's config has no max_position_embeddings: give {flag}")
    return int(value)


def rotation_choice(options: QuantCacheConfig, given: dict) -> tuple[bool, bool]:
    """What a calibration measures by default for `options` built from the options `given` explicitly: whether keys
    are rotated too (with a rotation, unless `rotate` was given) and whether rotated keys also try Lloyd-Max levels
    (unless `levels` was given)."""
    return options.rotation != "none" and "rotate" not in given, "levels" not in given


NEEDLE_FLOOR_LENGTH = 2048  # default tokens of the needle floors' haystack (at most the model's context)
NEEDLE_FLOOR_COUNT = 16  # needles in it


def needle_length(model, length: int | None) -> int:
    """Tokens of the needle floors' haystack: `length`, or NEEDLE_FLOOR_LENGTH; at most the model's context."""
    context = max_context(model, "--needle-floor")
    if length is None:
        return min(NEEDLE_FLOOR_LENGTH, context)
    if not 0 < length <= context:
        raise ValueError(f"needle_length={length} tokens: allowed 1 to the model's context, {context}")
    return int(length)


def calibrate_model(model, tokenizer, options: QuantCacheConfig, model_name: str, data: Path | None = None,
                    samples: int = 16, seq_len: int = 512, seed: int = 0, dtype: str | None = None,
                    progress: bool = True, budget: dict | None = None, choose_rotation: bool = False,
                    rotation_measure: tuple[int, int | None] = (1, None), try_levels: bool = True):
    """Calibrate a loaded model on `data` (default: the calibration split) -> CalibrationData (not saved).

    `dtype` is recorded in the file's settings; None records the dtype the model's weights are in. `budget`
    ({"budget": bits/value, "context": tokens, "samples": n, "seq_len": L, optional "needle_floor": nats and
    "needle_length": tokens}) also chooses per-layer widths, measured on n other sequences of L tokens of the same
    text; with "needle_floor" no layer's keys or values go narrower than what keeps needles in that text
    (`calibration.budget.needle_floors`: NEEDLE_FLOOR_COUNT needles in "needle_length" tokens, default
    NEEDLE_FLOOR_LENGTH or the model's context if shorter). `choose_rotation` chooses whether keys are rotated too
    (`calibration.budget.choose_rotate`; rotated keys also tried on Lloyd-Max levels with `try_levels`), measured on
    `rotation_measure` = (n, L): n sequences of L tokens, L None for the model's maximum context (the context the
    cache is for: on SmolLM2-135M at 2 bits, 2048 tokens rank uniform levels first and 8192 Lloyd-Max)."""
    from calibration import calibrate

    from qcache.tools.data import read_split, sha256_of_split

    if data is not None:
        text, source = read_text(data), str(data)
        sha = hashlib.sha256(data.read_bytes()).hexdigest()
    else:
        text, source, sha = read_split("calibration"), "dataset_build eng (qcache.tools.data calibration split)", \
            sha256_of_split("calibration")
    ids = sample_sequences(tokenizer, text, samples, seq_len, seed)
    if dtype is None:
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    settings = {"model": model_name, "data_source": source, "data_sha256": sha, "samples": samples,
                "seq_len": seq_len, "dtype": dtype}
    sens_ids = rotation_ids = None
    needles = None
    if budget is not None and budget.get("needle_floor") is not None:
        needles = {"tokenizer": tokenizer, "text": text, "threshold": budget["needle_floor"],
                   "length": needle_length(model, budget.get("needle_length")), "count": NEEDLE_FLOOR_COUNT}
    if budget is not None:
        sens_ids = sample_sequences(tokenizer, text, budget["samples"], budget["seq_len"], seed + 1,
                                    "--sensitivity-samples/--sensitivity-len")
    if choose_rotation:
        n, length = rotation_measure
        if length is None:
            length = max_context(model, "--rotation-len")
        rotation_ids = sample_sequences(tokenizer, text, n, length, seed + 2, "--rotation-samples/--rotation-len")
    return calibrate(model, ids, options, settings, seed=seed, progress=progress,
                     budget=budget["budget"] if budget is not None else None,
                     context=budget["context"] if budget is not None else None, sensitivity_ids=sens_ids,
                     choose_rotation=choose_rotation, try_levels=try_levels, rotation_ids=rotation_ids,
                     needles=needles)


def parse_option(text: str) -> tuple[str, object]:
    """"NAME=VALUE" -> (name, value typed as the QuantCacheConfig field, `qcache.tools.spec.typed_option`)."""
    from qcache.tools.spec import typed_option

    name, sep, raw = text.partition("=")
    fields = sorted(f.name for f in dataclasses.fields(QuantCacheConfig) if f.name != "layer_bits")
    if not sep or name not in fields:
        raise ValueError(f"--option {text!r}: expected NAME=VALUE with NAME one of {fields}")
    try:
        return name, typed_option(name, raw)
    except ValueError as err:
        raise ValueError(f"--option {text!r}: {err}") from None


def cache_options(spec: str) -> dict:
    """`--cache quant[:BITS][:NAME=VALUE,...]` (the spec syntax of eval and bench, `qcache.tools.spec`) -> the options
    given, typed, with `bits` as k_bits and v_bits."""
    from qcache.tools.spec import parse_spec, typed_options

    _, bits, raw = parse_spec(spec, ("quant",))
    given = typed_options(raw)
    if "layer_bits" in given:
        raise ValueError(f"--cache {spec!r}: layer_bits is what --bits-per-value chooses; allowed: leave it out")
    if bits is not None:
        if {"k_bits", "v_bits", "preset"} & set(given):
            raise ValueError(f"--cache {spec!r}: bits={bits} and {sorted({'k_bits', 'v_bits', 'preset'} & set(given))} "
                             "both choose the widths; allowed: one of them")
        given = {"k_bits": bits, "v_bits": bits, **given}
    return given


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qcache.calibrate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from qcache.tools.models import MODELS

    p.add_argument("--model", default="smollm2-135m",
                   help=f"short name ({', '.join(sorted(MODELS))}) or HF directory")
    p.add_argument("--out", type=Path, help="output .safetensors path (written atomically)")
    p.add_argument("--save-dir", type=Path,
                   help="also write a folder laid out like a hub repo: the file + README.md model card")
    p.add_argument("--push-to-hub", metavar="ORG/NAME",
                   help="upload that folder to this hub repo (created if missing; needs the network and a token)")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    p.add_argument("--quality", type=Path,
                   help="a markdown file of measured quality (e.g. eval.compare's .md) for the model card")
    p.add_argument("--bits", type=int, choices=SUPPORTED_BITS, help="bits for K and V (default 4)")
    p.add_argument("--k-bits", type=int, choices=SUPPORTED_BITS, help="bits for keys")
    p.add_argument("--v-bits", type=int, choices=SUPPORTED_BITS, help="bits for values")
    p.add_argument("--static-keys", action=argparse.BooleanOptionalAction, default=None,
                   help="store the option to quantize keys with static calibrated ranges (default: QuantCacheConfig)")
    p.add_argument("--outliers", type=int, default=None,
                   help="QuantCacheConfig.outliers stored with the file; codebooks are fitted without them (default: "
                        "QuantCacheConfig's, 0; outliers ask for min-max value groups instead of one scale per token)")
    p.add_argument("--choose-rotation", action=argparse.BooleanOptionalAction, default=None,
                   help="measure whether keys are rotated too (rotate='v', 'kv', or 'kv' with levels='lloyd-max' unless "
                        "--option levels= is given: the lowest KL on --rotation-samples sequences of "
                        "--rotation-len tokens) and store the choice (default: on with a rotation unless --option "
                        "rotate= is given)")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="any other QuantCacheConfig option stored with the file (repeatable)")
    p.add_argument("--cache", metavar="SPEC",
                   help="the cache as eval and bench write it, quant[:BITS][:NAME=VALUE,...] (e.g. quant:3:rotate=v, "
                        "quant::preset=k3v2); instead of --bits, --k-bits, --v-bits, --static-keys, --outliers, --option")
    p.add_argument("--bits-per-value", type=float,
                   help="choose per-layer widths (2/3/4 bits for keys and values) within this budget of bits/value")
    p.add_argument("--needle-floor", type=float, metavar="NATS",
                   help="with --bits-per-value: no layer's keys or values narrower than the width at which needles "
                        "in calibration text lose at most NATS of answer log-probability (measured per layer and "
                        "stream, e.g. 0.15)")
    p.add_argument("--needle-length", type=int, metavar="TOKENS",
                   help=f"with --needle-floor: tokens of calibration text the needles are placed in (default "
                        f"{NEEDLE_FLOOR_LENGTH}, or the model's context if shorter)")
    p.add_argument("--context", type=int,
                   help="with --bits-per-value: the context the budget is counted at (default: the model's maximum)")
    p.add_argument("--sensitivity-samples", type=int, default=None,
                   help="with --bits-per-value: sequences the layer sensitivities are measured on (default 1)")
    p.add_argument("--sensitivity-len", type=int, default=None,
                   help="tokens per such sequence (default 2048)")
    p.add_argument("--rotation-samples", type=int, default=1,
                   help="sequences the rotation choice is measured on (default 1)")
    p.add_argument("--rotation-len", type=int, default=None,
                   help="tokens per such sequence (default: the model's maximum context, e.g. 8192 for "
                        "SmolLM2-135M: minutes per choice on a CPU)")
    p.add_argument("--data", type=Path, help="a .txt or .jsonl ('text' field) file; default: the calibration split")
    p.add_argument("--samples", type=int, default=16, help="sequences of calibration text")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0, help="seed for picking sequences and subsampling")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="model dtype")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.bits is not None and (args.k_bits is not None or args.v_bits is not None):
        p.error("give --bits, or --k-bits/--v-bits, not both")
    if args.samples < 1 or args.seq_len < 8:
        p.error(f"--samples={args.samples} must be >= 1 and --seq-len={args.seq_len} >= 8")
    if args.bits_per_value is None and (args.sensitivity_samples, args.sensitivity_len) != (None, None):
        p.error("--sensitivity-samples/--sensitivity-len size the per-layer measurement of --bits-per-value, which "
                "was not given (the rotation choice is sized by --rotation-samples/--rotation-len)")
    if args.rotation_samples < 1 or (args.rotation_len is not None and args.rotation_len < 8):
        p.error(f"--rotation-samples={args.rotation_samples} must be >= 1 and --rotation-len={args.rotation_len} "
                ">= 8")
    if args.out is None and args.save_dir is None and args.push_to_hub is None:
        p.error("give --out FILE, --save-dir DIR and/or --push-to-hub ORG/NAME")
    if args.quality is not None and args.save_dir is None and args.push_to_hub is None:
        p.error("--quality goes into the model card: give --save-dir or --push-to-hub too")
    if args.quality is not None and not args.quality.is_file():
        p.error(f"--quality {str(args.quality)!r} does not exist")
    from qcache import hub
    from qcache.tools import publish

    if args.push_to_hub is not None:
        if not hub.looks_like_repo_id(args.push_to_hub):
            p.error(f"--push-to-hub {args.push_to_hub!r} is not a hub repo id; allowed: ORG/NAME")
        if hub.is_offline():  # before an hour of calibration, not after
            p.error("--push-to-hub needs the network, but HF_HUB_OFFLINE=1; use --save-dir and push later")

    from qcache.tools.models import load_model

    try:
        if args.cache is not None:
            also = [flag for flag, value in (("--bits", args.bits), ("--k-bits", args.k_bits), ("--v-bits", args.v_bits),
                                             ("--static-keys", args.static_keys), ("--outliers", args.outliers),
                                             ("--option", args.option or None)) if value is not None]
            if also:
                p.error(f"--cache {args.cache!r} gives the whole cache; allowed without it: {', '.join(also)}")
            opts = cache_options(args.cache)
            options = recipe(preset=opts.pop("preset", None), **opts)
        else:
            opts = {"k_bits": args.k_bits or args.bits or 4, "v_bits": args.v_bits or args.bits or 4}
            if args.static_keys is not None:
                opts["static_keys"] = args.static_keys
            if args.outliers is not None:
                opts["outliers"] = args.outliers
            opts.update(parse_option(text) for text in args.option)
            options = recipe(**opts)
    except ValueError as err:
        p.error(str(err))
    choose_default, try_levels = rotation_choice(options, opts)
    choose_rotation = args.choose_rotation
    if choose_rotation is None:
        choose_rotation = choose_default
    elif choose_rotation and options.rotation == "none":
        p.error("--choose-rotation needs a rotation; these options have rotation='none' (allowed: "
                "--no-choose-rotation, or --option rotation=hadamard)")
    from qcache.layers import check_calibration_options

    try:  # a file whose options refuse its own codebooks would not load
        check_calibration_options(options, True)
    except ValueError as err:
        p.error(f"the options stored with the file refuse its codebooks: {err}")
    if args.bits_per_value is not None and args.bits_per_value <= 0:
        p.error(f"--bits-per-value={args.bits_per_value} must be positive")
    if args.needle_floor is not None and (args.bits_per_value is None or not args.needle_floor > 0):
        p.error(f"--needle-floor={args.needle_floor} sets floors under the per-layer widths of --bits-per-value: "
                "give --bits-per-value with it, and a threshold > 0 nats")
    if args.needle_length is not None and (args.needle_floor is None or args.needle_length <= 0):
        p.error(f"--needle-length={args.needle_length} is the haystack of --needle-floor: give --needle-floor with "
                "it, and a length > 0 tokens")
    t0 = time.perf_counter()
    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype))
    budget = None
    if args.bits_per_value is not None:
        context = args.context or max_context(model, "--context")
        budget = {"budget": args.bits_per_value, "context": context, "samples": args.sensitivity_samples or 1,
                  "seq_len": args.sensitivity_len or 2048, "needle_floor": args.needle_floor,
                  "needle_length": args.needle_length}
    data = calibrate_model(model, tok, options, args.model, args.data, args.samples, args.seq_len, args.seed,
                           args.dtype, budget=budget, choose_rotation=choose_rotation,
                           rotation_measure=(args.rotation_samples, args.rotation_len), try_levels=try_levels)
    data.settings["seconds"] = round(time.perf_counter() - t0, 1)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_calibration(args.out or Path(tmp) / hub.CALIBRATION_FILENAME, data)
        print(f"{'wrote ' + str(path) if args.out else 'calibrated'}: {len(data.layers)} layers, "
              f"{data.settings['tokens']} tokens, {data.settings['seconds']} s")
        if args.save_dir is not None or args.push_to_hub is not None:
            quality = args.quality.read_text() if args.quality is not None else None
            folder = publish.save_folder(path, args.save_dir or Path(tmp) / "repo", quality, args.push_to_hub)
            if args.save_dir is not None:
                print(f"wrote {folder}: {hub.CALIBRATION_FILENAME} + {hub.CARD_FILENAME}")
            if args.push_to_hub is not None:
                print(f"pushed to {args.push_to_hub}: {publish.push_to_hub(folder, args.push_to_hub, args.private)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
