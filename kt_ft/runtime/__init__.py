"""The model changed in place: ``apply`` (``core``) places modules, replaces the routed experts by
``KTExperts`` (the CPU op, resident, streamed and beside-GPU experts), adds the expert LoRA, the
fused paths and the adapter hooks; loading straight from the files, run-time re-planning,
data parallelism and the run's reports.
"""
