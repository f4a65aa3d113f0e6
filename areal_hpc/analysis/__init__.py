"""Offline analysis of rollout logs: summary numbers, plots, export (`python -m areal_hpc.analysis`)."""
