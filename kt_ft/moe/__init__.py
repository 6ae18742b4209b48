"""The KT MoE layer: the CPU expert autograd op and the module that replaces HF's experts."""
