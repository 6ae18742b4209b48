"""Export a kt-ft adapter: per-expert PEFT keys for vLLM / SGLang (``convert``), or folded into
the base weights as a plain transformers checkpoint (``merge``)."""

from kt_ft.integrations.export.adapter import KTAdapter, read_kt_adapter
from kt_ft.integrations.export.convert import convert_adapter
from kt_ft.integrations.export.merge import merge_adapter

__all__ = ["KTAdapter", "convert_adapter", "merge_adapter", "read_kt_adapter"]
