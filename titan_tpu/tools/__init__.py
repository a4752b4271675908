"""The commands over the whole stack (compile, plan, verify, report, generate, hf-sweep, the recipe
table, compat): they may import every other layer; only the entry points (cli.py) import them. What
XLA made of a program is read by xla/, below them."""
