"""Quantized base weights: formats (fp8 blocks, int4 packed, int8 channels, mxfp4 groups), their plain
reference twins, the expert weight kept quantized in RAM, reading it from the files, and
detecting a checkpoint's format from its config."""

from .detect import detect_format
from .formats import FORMATS, QuantFormat
from .weights import QuantizedExperts, is_quantized

__all__ = ["FORMATS", "QuantFormat", "QuantizedExperts", "detect_format", "is_quantized"]
