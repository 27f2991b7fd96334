"""Adapters that put zerostall under the training frameworks people already run; each imports its
framework, installed with its extra (``pip install zerostall[deepspeed]``)."""
