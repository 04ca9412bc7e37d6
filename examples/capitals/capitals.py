"""The reward and the accuracy of the capitals example (docs/extending.md): functions in TRL's
signature, `f(prompts, completions, **columns) -> list[float]`, one value per completion. Every
column of capitals.jsonl arrives as a keyword holding one value per completion (`aliases`,
`country`), and `answer` always does."""


def capital_reward(prompts, completions, aliases, **kwargs):
    """1 when the completion names the capital (any alias), minus 0.001 a word for rambling."""
    return [float(any(a.lower() in c.lower() for a in names)) - 0.001 * len(c.split())
            for c, names in zip(completions, aliases)]


def capital_accuracy(prompts, completions, aliases, **kwargs):
    """What metrics and held-out evaluation count: the completion starts with the capital (any alias)."""
    said = [c.strip().lower() for c in completions]
    return [float(any(s.startswith(a.lower()) for a in names)) for s, names in zip(said, aliases)]
