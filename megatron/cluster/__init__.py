"""What the machines say, read without any other part of megatron: hostfiles and the launchers' rank variables.

The config layer (``neox_arguments``: the world size a hostfile implies), the launcher (which hosts to start) and
``megatron/distributed.py`` (RANK/WORLD_SIZE from torchrun, DeepSpeed, srun or mpirun) all build on it.
"""
