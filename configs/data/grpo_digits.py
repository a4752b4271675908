"""The rewards of the GRPO debug recipe (configs/llama3_debug_grpo.toml, docs/grpo.md): each prompt
names a digit among two words ("gold 7 teal:"), and a completion is rewarded by how much of it is
that digit. The recipe weighs two shares of the completion's characters (white space aside; an
empty completion scores 0): `any_digit` (a little: a randomly initialised model writes a digit now
and then, so the reward varies within a group from the first step) and `prompt_digit` (most: the
digit the prompt names, which the policy must copy from the prompt). `right_digit`, whether the
completion starts with the prompt's digit, is logged beside them with weight 0."""


def _chars(text):
    return [c for c in text if not c.isspace()]


def any_digit(prompts, completions, **kwargs):
    return [sum(c.isdigit() for c in _chars(t)) / len(_chars(t)) if _chars(t) else 0.0 for t in completions]


def prompt_digit(prompts, completions, answer, **kwargs):
    return [sum(c == d for c in _chars(t)) / len(_chars(t)) if _chars(t) else 0.0 for t, d in zip(completions, answer)]


def right_digit(prompts, completions, answer, **kwargs):
    return [float(t.strip()[:1] == d) for t, d in zip(completions, answer)]
