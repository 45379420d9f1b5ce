"""Peer frameworks bench_train.py compares with, each run its own default way in its own venv (see README.md)."""
