"""Front ends over the runtime: LLaMA-Factory (``llamafactory``, hooked by the start-up ``.pth``),
the HF Trainer (``trainer``), the ``kt-ft`` command (``cli``), ``kt-ft bench`` (a leaf only the
CLI imports), export for serving engines (``export``) and the demo models (``demo``).
"""
