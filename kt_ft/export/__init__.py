"""Export a kt-ft adapter: per-expert PEFT keys for vLLM / SGLang (``convert``), or folded into
the base weights as a plain transformers checkpoint (``merge``)."""

from .adapter import KTAdapter, read_kt_adapter
from .convert import convert_adapter
from .merge import merge_adapter

__all__ = ["KTAdapter", "convert_adapter", "merge_adapter", "read_kt_adapter"]
