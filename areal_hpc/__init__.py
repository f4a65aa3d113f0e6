"""areal_hpc: asynchronous RL for LLM reasoning (AReaL) as a Slurm/HPC batch pipeline."""
__version__ = "0.1.0"
