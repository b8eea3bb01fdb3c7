"""Autotuning of ``tunable`` parameters and the tuning database ``expand`` reads."""
