"""A small labelled task mix the sharing and specialty tests share: 1-digit addition and subtraction as two
specialties, and an unlabelled chain sum (a task without a specialty of its own)."""

ARITHMETIC = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 1,
    "operators": ["+"],
    "allow_negation": False,
    "allow_parentheses": False,
    "format_style": "simple",
}
MIX = [
    {"name": "basic_arithmetic", "config": ARITHMETIC, "label": "add"},
    {"name": "basic_arithmetic", "config": {**ARITHMETIC, "operators": ["-"]}, "label": "subtract"},
    {"name": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}},
]
