"""Launching a user script on every rank: DeepSpeed's runner locally, pdsh/openmpi/mvapich/slurm across nodes."""
