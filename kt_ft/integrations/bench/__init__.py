"""`kt-ft bench`: the CPU expert op (``op``), a full training step per system (``step``, its
random models ``models``), tokens/s against the GPU memory cap per placement (``placement``,
its kt-ft side in a worker ``placement_system``), LLaMA-Factory end to end (``e2e``, with its
``e2e_*`` modules and ``vl_assets``) and generation through it (``generate``); one-off
measurements the bench does not take are in ``probes``.

Kept empty: the CLI imports only the parts it runs.
"""
