"""Tools over the whole stack (verify, compat, report, hf-sweep): they may import every other layer; only the entry
points (cli.py) import them."""
