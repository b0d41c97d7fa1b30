"""`python -m eval ...`: lm-eval's command line with the project's adapter and tasks.

Takes lm-eval's usual arguments (`lm-eval run --help`). On top of lm-eval it
  - uses `--model qcache` (eval/adapter.py) unless another model is named;
  - adds eval/tasks (qcache_ppl, qcache_passkey) to the task search path;
  - resolves short model names (`pretrained=smollm2-135m`, also in `--metadata` `tokenizer`) to their local
    directories, so RULER's tasks can load the tokenizer;
  - runs offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE default to 1; see eval.harness.offline_environment);
  - uses the CPU when no GPU is present.

Examples:
    python -m eval --model_args pretrained=smollm2-135m,cache=quant,bits=4 --tasks qcache_ppl --limit 2
    python -m eval --model_args pretrained=smollm2-135m,cache=hf-quanto,bits=2 --tasks niah_single_1 \\
        --metadata '{"max_seq_lengths": [1024]}' --gen_kwargs max_gen_toks=16 --limit 5
"""

from __future__ import annotations

import sys

from .harness import TASKS_DIR, offline_environment, resolve_names


def _has_flag(argv: list[str], *names: str) -> bool:
    return any(a == n or a.startswith(n + "=") for a in argv for n in names)


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's CLI with our defaults (see the module docstring)."""
    offline_environment()
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from . import adapter  # noqa: F401 - registers --model qcache

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in ("run", "ls", "validate", "-h", "--help"):
        argv.insert(0, "run")
    if argv and argv[0] == "run":
        if not _has_flag(argv, "--model", "-M"):
            argv += ["--model", "qcache"]
        if not _has_flag(argv, "--device"):
            import torch

            argv += ["--device", "cuda" if torch.cuda.is_available() else "cpu"]
    setup_logging()
    cli = HarnessCLI()
    sys.argv = [sys.argv[0], *argv]  # HarnessCLI reads sys.argv
    args = cli.parse_args()
    if getattr(args, "command", None) in ("run", "ls", "validate"):
        extra = getattr(args, "include_path", None)
        args.include_path = [str(TASKS_DIR)] + ([extra] if extra else [])
    if getattr(args, "command", None) == "run":
        args.model_args = resolve_names(args.model_args)
        if isinstance(args.metadata, dict):
            args.metadata = resolve_names(args.metadata)
    cli.execute(args)


if __name__ == "__main__":
    main()
