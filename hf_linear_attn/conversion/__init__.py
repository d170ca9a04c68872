"""Pretrained softmax checkpoints into this package's families, behind scripts/convert.py.

convert: build the target family from a RoBERTa / GPT-2 checkpoint and copy every shared weight; distill: train
only the new attention parameters against the softmax teacher; cli: the script's arguments and steps.
"""
