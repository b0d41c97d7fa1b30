"""Applications built on the qcache runtime: the offline model registry and text (`models`, `data`), sizing
(`size`), the demo, the vLLM export and publishing calibration files (`publish`). The runtime never imports them."""
