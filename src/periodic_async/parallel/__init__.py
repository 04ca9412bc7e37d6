"""Trainer ranks over torch.distributed (torchrun): data parallel or FSDP2, streaming kept exact.

    distributed.py   `Ranks`: the groups handed out in completion order, one collective step per
                     iteration, checkpoints in the single-process format
"""
