"""Metrics: one API in front of console, TensorBoard and W&B sinks; FLOPs/MFU."""
