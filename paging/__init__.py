"""Host-side paging for the chunk-window KV cache: pool, sessions, eviction, forward plans.

Builds the tensors the kernels consume (slot mappings, fixed-width block tables, lengths).
Only ``paging.forward`` (one forward through the fused op) imports ``kernels``; it is not
imported here, so bookkeeping alone never loads Triton. The contract is DESIGN section 4.
"""

from paging.batch import batch_plans
from paging.block_size import paging_block_size
from paging.cache import LayerCache, PagedKVCache
from paging.config import PagingConfig
from paging.plan import AttentionInputs, ForwardPlan, PlanState
from paging.pool import NULL_BLOCK, BlockPool, PoolExhaustedError
from paging.session import Sequence, Session
from paging.staging import HistoryStaging, StagingDecision

__all__ = [
    "NULL_BLOCK",
    "AttentionInputs",
    "BlockPool",
    "ForwardPlan",
    "HistoryStaging",
    "LayerCache",
    "PagedKVCache",
    "PagingConfig",
    "PlanState",
    "PoolExhaustedError",
    "Sequence",
    "Session",
    "StagingDecision",
    "batch_plans",
    "paging_block_size",
]
