"""Split fine-tuning (Shi et al.): an edge part and a cloud part of one pretrained encoder.

``lowcomm split`` (docs/split.md) runs it; :class:`SplitModel` turns an existing fine-tuning
loop into its two halves (docs/split_api.md). The names below load on first use, so that
``lowcomm split --help`` and its one-line errors do not import torch.
"""

from __future__ import annotations

from lowcomm.registry import lazy_exports


#: public name -> the module that defines it
_EXPORTS = {
    "SplitModel": "lowcomm.split.model", "SplitEdge": "lowcomm.split.model", "SplitCloud": "lowcomm.split.model",
    "BertClassifier": "lowcomm.split.bert", "BertConfig": "lowcomm.split.bert",
    "load_bert": "lowcomm.split.checkpoint", "build_classifier": "lowcomm.split.checkpoint",
    "load_text_data": "lowcomm.split.data", "factorize_linear": "lowcomm.split.factorize",
    "SplitConfig": "lowcomm.split.config", "run_split": "lowcomm.split.runner",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
