"""Probes: one-off measurements that ``kt-ft bench`` does not take, each run as
``python -m kt_ft.integrations.bench.probes.<name>`` (from a checkout; ``scripts/device_run.sh``
runs the GPU machine's). None is imported by kt-ft; each module imports on its own without running.

The CPU expert op and its products:

- ``op_faults``: one op call's time with its page faults and system time;
- ``profile_op``: one op call under torch.profiler, matmul time by product kind;
- ``gemm_probe``: every bf16 GEMM orientation the op needs, one expert's shapes;
- ``loop_probe``: the per-expert products in a loop over 128 experts (``out=``, fp32, one bmm);
- ``q_probe``: the backward's dY Wd product with ``out=`` against an assignment;
- ``bmm_probe``: the per-expert loop against batched and prepacked formulations, routing skewed too;
- ``native_gemm_probe``: each native GEMM path against torch's bf16 / fp32 matmul;
- ``grouped_scaling_probe``: the native grouped GEMMs against the thread count.

The GPU side and the host:

- ``expert_gpu_probe``: one MoE layer's GPU time and kernels, kt-ft's fused experts against
  transformers' ``grouped_mm``;
- ``expert_host_probe``: the same layer's host time a pass under reentrant checkpointing;
- ``nonexpert_host_probe``: a step's non-expert host time, PEFT as shipped against kt-ft's fusions;
- ``register_probe``: host -> GPU copy rate from pageable, pinned and registered memory.

Memory and plots:

- ``load_memory``: peak RSS while loading a checkpoint, per loading method (``tests/test_load_memory.py``);
- ``ddp_memory``: RSS / PSS per rank of data-parallel kt-ft for 1, 2, 4 processes;
- ``plot_placement``: one placement plot from several ``kt-ft bench --parts placement --json`` files.
"""
