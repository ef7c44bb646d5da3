"""Choosing a kernel's optimisation options: one home for every rule that picks them."""
