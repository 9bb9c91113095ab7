"""Judgement on host values: each detector is pure and state_dict-able."""
