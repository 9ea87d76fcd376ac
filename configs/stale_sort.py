"""The staleness testbed's base run on digit sorting: ``configs/stale_base.py`` (same model,
warm-up and method) with ``sort_digits``, whose response length is the list length, so length
varies without the arithmetic (``data.mixture`` lists the lengths and their weights)."""

import importlib.util
import os

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stale_base.py")


def get_config():
    spec = importlib.util.spec_from_file_location("stale_base", _BASE)
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    c = base.get_config()
    c.name = "stale_sort"
    c.data.task = "sort_digits"
    c.data.mixture = "16:1,24:1,32:1"
    c.data.max_prompt_len = 34  # 32 digits, "=" and BOS
    c.data.max_new_tokens = 34  # 32 digits and EOS, one spare
    return c
