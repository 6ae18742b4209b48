"""The ``kt-ft`` command and the model-type survey it runs (``kt-ft models``)."""
