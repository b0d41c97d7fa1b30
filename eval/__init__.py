"""Evaluation with lm-eval: the project's model adapter (`--model qcache`), tasks and comparison runner.

    python -m eval ...            lm-eval's CLI with the adapter and our tasks (eval/__main__.py)
    python -m eval.compare ...    several caches and bit widths in one run -> docs/results/ (eval/compare.py)

    eval/adapter.py     QCacheLM: HFLM routing log-likelihood and generation through the chosen KV cache
    eval/harness.py     offline settings, task paths, short model names
    eval/tasks/         qcache_ppl (perplexity of the "eval" text split), qcache_passkey

Importing this package stays light: lm-eval is imported by the modules above, where used.
"""
