"""`python -m eval ...`: lm-eval's own command line (its `lm_eval` console entry point) with the project's adapter
and tasks.

Takes lm-eval's usual arguments (`lm-eval run --help`). Before handing the command line to lm-eval it
  - imports eval.adapter, which registers `--model qcache` (used unless another model is named);
  - adds `--include_path eval/tasks` (qcache_ppl, qcache_passkey; lm-eval's CLI takes one include path, so a
    command that names its own is refused: run `lm_eval` itself for other task folders);
  - resolves short model names (`pretrained=smollm2-135m`, also `tokenizer` in `--model_args` / `--metadata`) to
    their local directories, so RULER's tasks can load the tokenizer;
  - runs offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE default to 1; see eval.harness.offline_environment);
  - uses the CPU when no GPU is present.

Only lm-eval's public entry point is used (`lm_eval.__main__.cli_evaluate`, what the `lm_eval` command runs); the
rewriting works on the command line itself, so lm-eval's parser stays the only one.

Examples:
    python -m eval --model_args pretrained=smollm2-135m,cache=quant,bits=4 --tasks qcache_ppl --limit 2
    python -m eval --model_args pretrained=smollm2-135m,cache=hf-quanto,bits=2 --tasks niah_single_1 \\
        --metadata '{"max_seq_lengths": [1024]}' --gen_kwargs max_gen_toks=16 --limit 5
"""

from __future__ import annotations

import json
import sys

from .harness import TASKS_DIR, offline_environment, resolve_names

__all__ = ["SUBCOMMANDS", "rewrite_argv", "main"]

SUBCOMMANDS = ("run", "ls", "validate")
_DICT_OPTIONS = ("--model_args", "-a", "--metadata")


def _has_flag(argv: list[str], *names: str) -> bool:
    return any(a == n or a.startswith(n + "=") for a in argv for n in names)


def _resolve_value(value: str) -> str:
    """One value of --model_args / --metadata ('k=v,k2=v2' or a JSON object) with short model names resolved."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        return json.dumps(resolve_names(parsed))
    pairs = []
    for item in value.split(","):
        key, eq, val = item.partition("=")
        if eq and key.strip() in ("pretrained", "tokenizer"):
            val = resolve_names({"pretrained": val})["pretrained"]
        pairs.append(f"{key}{eq}{val}")
    return ",".join(pairs)


def _resolve_dict_options(argv: list[str]) -> list[str]:
    """argv with the values of --model_args / --metadata (each may take several words) resolved."""
    out, in_dict = [], False
    for arg in argv:
        if arg.startswith("-"):
            name, eq, value = arg.partition("=")
            in_dict = name in _DICT_OPTIONS and not eq
            out.append(f"{name}={_resolve_value(value)}" if eq and name in _DICT_OPTIONS else arg)
        else:
            out.append(_resolve_value(arg) if in_dict else arg)
    return out


def rewrite_argv(argv: list[str]) -> list[str]:
    """The command line lm-eval gets for `python -m eval <argv>` (see the module docstring).

    Example:
        >>> rewrite_argv(["--tasks", "qcache_ppl", "--model", "hf", "--device", "cpu"])[:6]
        ['run', '--tasks', 'qcache_ppl', '--model', 'hf', '--device']
    """
    argv = list(argv)
    if argv and argv[0] not in SUBCOMMANDS + ("-h", "--help"):
        argv.insert(0, "run")
    if not argv or argv[0] not in SUBCOMMANDS:
        return argv
    if _has_flag(argv, "--include_path"):
        raise ValueError(f"python -m eval adds --include_path {TASKS_DIR} itself and lm-eval's CLI takes only one; "
                         "for other task folders run `lm_eval run --include_path <dir> ...` (see eval/README.md)")
    argv += ["--include_path", str(TASKS_DIR)]
    if argv[0] == "run":
        if not _has_flag(argv, "--model", "-M"):
            argv += ["--model", "qcache"]
        if not _has_flag(argv, "--device"):
            import torch

            argv += ["--device", "cuda" if torch.cuda.is_available() else "cpu"]
        argv = _resolve_dict_options(argv)
    return argv


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's CLI with our defaults (see the module docstring)."""
    offline_environment()
    from lm_eval.__main__ import cli_evaluate

    from . import adapter  # noqa: F401 - registers --model qcache

    try:
        args = rewrite_argv(sys.argv[1:] if argv is None else argv)
    except ValueError as err:
        raise SystemExit(f"python -m eval: {err}") from err
    saved = sys.argv
    sys.argv = [saved[0], *args]  # the console entry point reads sys.argv, as the `lm_eval` command does
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
