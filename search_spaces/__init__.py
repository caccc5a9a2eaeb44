"""Which strategies exist for a model on a cluster, and how an Optuna trial samples one.

Pure Python: importing this package never imports torch.

Example:
    >>> from search_spaces import SearchSpace
    >>> space = SearchSpace("llama3-70b", "h100-sxm:32x8", global_batch_size=512,
    ...                     config="megatron")
    >>> space.size > 0
    True
"""

from search_spaces._base import BaseSearchSpace
from search_spaces._config import SpaceConfig, shipped_spaces
from search_spaces._listed import ListedSpace
from search_spaces._parallel import LAYOUT_FIELDS, Layout, SearchSpace, pipeline_label

__all__ = [
    "LAYOUT_FIELDS",
    "BaseSearchSpace",
    "Layout",
    "ListedSpace",
    "SearchSpace",
    "SpaceConfig",
    "pipeline_label",
    "shipped_spaces",
]
