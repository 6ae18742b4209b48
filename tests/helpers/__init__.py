"""Helpers shared by the tests: no test module imports another, they import these.

Importable as ``helpers.<module>`` because pytest puts tests/ on sys.path (tests/ has no
``__init__.py``: rootdir-relative "prepend" import mode); a subprocess the tests start that imports
one puts tests/ on its PYTHONPATH. One module per concern:

- ``compare``: seeds and relative-tolerance comparisons of a kt-ft replacement with the original.
- ``tiny_models``: tiny random fp32 models of the supported families, built from configs.
- ``moe_inputs``: random routed-expert problems (weights, LoRA, inputs, routing, upstream grad).
- ``kernels``: running one CPU expert backend on such a problem, comparing two backends' results.
- ``parity``: the kt-ft / transformers + PEFT model pair and its training loop.
- ``resident``: the GPU-resident-expert tests' tiny model, batches, AdamW and training loops.
- ``families``: what a family's config says about its layers.
- ``lm_loss``: the chunked-loss twins (kt-ft's loss / the model's own).
- ``quant``: quantized-base checks shared by the quantization tests.
- ``kt_adapters``: in-process LLaMA-Factory loads of the demo model with kt-ft.
- ``lf_recipe``: the demo's LLaMA-Factory training arguments as a dict.
- ``lf_runs``: ``llamafactory-cli train`` runs as subprocesses and their results.
- ``lf_api``: ``llamafactory-cli api`` as a subprocess and requests to it.
- ``vl_runs``: the tiny vision-language demo's training run, in process.
"""
