"""Host-side paging for the chunk-window KV cache: pool, sessions, eviction, forward plans.

Builds the tensors the kernels consume (slot mappings, fixed-width block tables, lengths).
Only ``paging.forward`` (one forward through the fused op) imports ``kernels``; it is not
imported here, so bookkeeping alone never loads Triton. The rules are in docs/paging.md.
"""

if __name__ != "paged_video.paging":  # a bare `import paging` found this clone's folder
    from paged_video._clone import hand_over

    hand_over(__name__, __file__)
else:
    from paged_video.paging.batch import batch_plans
    from paged_video.paging.block_size import paging_block_size
    from paged_video.paging.cache import BlockCounts, LayerCache, PagedKVCache
    from paged_video.paging.config import PagingConfig
    from paged_video.paging.plan import AttentionInputs, ForwardPlan, PlanState
    from paged_video.paging.pool import NULL_BLOCK, BlockPool, PoolExhaustedError, PoolStats
    from paged_video.paging.session import Sequence, Session, TailWrite
    from paged_video.paging.staging import HistoryStaging, StagingDecision

__all__ = [
    "NULL_BLOCK",
    "AttentionInputs",
    "BlockCounts",
    "BlockPool",
    "ForwardPlan",
    "HistoryStaging",
    "LayerCache",
    "PagedKVCache",
    "PagingConfig",
    "PlanState",
    "PoolExhaustedError",
    "PoolStats",
    "Sequence",
    "Session",
    "StagingDecision",
    "TailWrite",
    "batch_plans",
    "paging_block_size",
]
