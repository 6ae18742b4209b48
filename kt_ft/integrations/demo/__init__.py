"""Tiny offline demo models: a random MoE of any family with a locally trained tokenizer and a
dataset (``text``), and a vision-language one with generated pictures (``vision``).
"""
