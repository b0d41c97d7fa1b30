"""lm-eval task configs (YAML) and their Python helpers; lm-eval loads them from this folder (--include_path)."""
