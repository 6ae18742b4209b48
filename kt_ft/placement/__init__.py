"""Where each routed expert runs: resident on the GPU, streamed to it, or on the CPU.

``cost`` predicts the time per resource (CPU, host->GPU link, GPU) and the GPU memory of a
split; ``planner`` chooses the split; ``measure`` gets the machine's rates (cached);
``auto`` applies the choice to a placement plan (rule action ``placement: auto``).
"""
