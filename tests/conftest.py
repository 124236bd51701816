"""Shared test set-up: the Triton interpreter without a GPU, hypothesis profiles, NaN fixtures,
the ``slow`` marker of the quick subset (``python -m pytest -m "not slow"``) and the ``smoke``
selection of the iteration loop (``python -m pytest -n 2 -m smoke``).

The interpreter must be switched on before any ``@triton.jit`` function is decorated, so this
runs before the test modules import ``kernels``.

Thread counts are pinned to one per process (unless set in the environment): under the
interpreter every kernel is many small numpy ops, and with ``pytest -n 2`` on two cores the
OpenMP/OpenBLAS pools of both workers fight over the cores, spinning while they wait. The
variables must be set before numpy or torch is imported (nothing imports them before this).
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import HealthCheck, settings

from tests.helpers import DEVICE, nan_like

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# `ci` is what CI runs (`--hypothesis-profile=ci`): more examples, no deadline, reproducible.
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# The default is quick, for iterating locally.
settings.register_profile(
    "dev",
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--library-device",
        default=None,
        help="make the tensors the library creates without a device on this one (meta: a CPU "
        "run then fails where a GPU run would put a CPU tensor beside CUDA data; "
        "tests/library_device.py)",
    )


# The --library-device mode's context and the mode itself, held for the whole run.
_LIBRARY_DEVICE = pytest.StashKey[tuple]()


def pytest_configure(config: pytest.Config) -> None:
    device = config.getoption("--library-device", None)
    if device:
        from tests.library_device import library_tensors_on

        context = library_tensors_on(device)
        config.stash[_LIBRARY_DEVICE] = (context, context.__enter__())


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if _LIBRARY_DEVICE in config.stash:
        mode = config.stash[_LIBRARY_DEVICE][1]
        terminalreporter.section(f"library tensors made on {mode.device}")
        for path, function, line in sorted(mode.moved):
            terminalreporter.write_line(f"{path}:{line} ({function})")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _LIBRARY_DEVICE in config.stash:
        config.stash[_LIBRARY_DEVICE][0].__exit__(None, None, None)


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def nan_out():
    """Factory fixture: ``nan_out(t)`` returns a NaN-filled tensor shaped like ``t``."""
    return nan_like


# The quick subset, ``python -m pytest -m "not slow"``, leaves out the tests below: each took
# over 4 s on a shared 2-core CPU (``--durations=0`` of the whole suite), together ~90% of the
# suite's CPU time. A prefix names a test function (every parametrization), one parametrization
# (``...[id]``) or a whole file. CI still runs everything; tests/test_slow_list.py checks that
# every entry still names a test.
SLOW = (
    "tests/bench/test_cli.py::test_the_readme_main_job_runs_the_small_preset",
    "tests/bench/test_cli_edges.py::test_wan_rollout_refuses_old_spellings_and_a_missing_gpu",
    "tests/bench/test_compile_report.py",
    "tests/bench/test_gpu_check.py::test_the_dry_run_runs_every_stage_and_writes_what_the_next_reads",
    "tests/bench/test_pipe_probe.py::test_each_loop_issues_what_its_mix_names",
    "tests/kernels/test_fused.py::test_compiles_once_across_changing_values[staged]",
    "tests/kernels/test_fused_quantized.py::test_compiles_once_across_changing_values",
    "tests/kernels/test_k8v8_attention.py::test_k8v8_frozen_scales[block_tiles-B1560-N64]",
    "tests/kernels/test_k8v8_attention.py::test_k8v8_frozen_scales[block_tiles-B1560-N128]",
    "tests/kernels/test_masks.py::test_launch_counts_five_segments",
    "tests/kernels/test_masks.py::test_one_launch_matches_oracle_and_dense",
    "tests/kernels/test_paged_attention.py::test_gaps_whole_tiles_mid_tile_overlapping_unsorted",
    "tests/kernels/test_paged_attention.py::test_gqa_packed_rows[B24-G5]",
    "tests/kernels/test_paged_attention.py::test_gqa_packed_rows[B24-G8]",
    "tests/kernels/test_paged_attention.py::test_gqa_packed_rows[B64-G8]",
    "tests/kernels/test_paged_attention.py::test_key_paths[block_tiles-B1560-N64]",
    "tests/kernels/test_paged_attention.py::test_property_matches_oracle",
    "tests/kernels/test_paged_attention.py::test_property_tiles_near_block_edges",
    "tests/kernels/test_paged_attention.py::test_rows_that_see_no_key_and_a_limit_of_zero",
    "tests/kernels/test_paged_attention.py::test_several_key_gaps_per_row[N16]",
    "tests/kernels/test_paged_attention_quantized.py::test_any_block_size[B1560-",
    "tests/kernels/test_paged_attention_quantized.py::test_key_paths_causal_limits_and_gaps[contiguous-B16-N16-",
    "tests/kernels/test_paged_attention_quantized.py::test_key_paths_causal_limits_and_gaps[rows-B1-N16-int8]",
    "tests/kernels/test_paged_attention_quantized.py::test_key_paths_causal_limits_and_gaps[rows-B16-N64-int8]",
    "tests/kernels/test_paged_attention_quantized.py::test_key_paths_causal_limits_and_gaps[two_blocks-",
    "tests/kernels/test_paged_attention_quantized.py::test_key_paths_causal_limits_and_gaps[block_tiles-",
    "tests/kernels/test_regrow_property.py::test_every_write_regrows_as_the_oracle_says[triton]",
    "tests/kernels/test_torch_path.py::test_cpu_process_without_interpreter",
    "tests/models/test_bench_wan.py::test_tiny_rollout_bench_runs_and_both_rollouts_agree",
    "tests/models/test_parallel.py::test_plan_check_runs_each_forward_and_switches_off",
    "tests/models/test_parallel.py::test_readme_block_runs_as_a_world_of_one",
    "tests/models/test_parallel.py::test_two_ranks_equal_one_process_and_diverged_plans_fail_on_both",
    "tests/models/test_parallel.py::test_ulysses_times_cfg_on_four_ranks",
    "tests/models/test_sharded_window.py::test_two_window_shards_equal_one_process_and_fail_together",
    "tests/models/test_sharded_window.py::test_ulysses_and_cfg_by_window_shards_on_four_ranks",
    "tests/models/test_readme_rollout.py::test_readme_rollout_block_runs",
    "tests/models/test_wan_compile.py::test_compiled_blocks_share_one_graph_over_the_rollout",
    "tests/models/test_wan_quantized.py::test_a_k8v8_block_whose_v_was_not_held_raises_at_its_end",
    "tests/models/test_wan_quantized.py::test_int8_rollout_staged_reset_whole_blocks_of_7_with_actions",
    "tests/models/test_wan_quantized.py::test_k8_format_rollouts_run_stay_near_and_stage_bit_for_bit",
    "tests/models/test_wan_quantized.py::test_sliding_window_rollout_on_quantized_pools",
    "tests/models/test_wan_rollout.py::test_no_sink_staged_single_branch_reuses_staging",
    "tests/models/test_wan_rollout.py::test_reset_at_boundary_blocks_of_7_with_actions",
    "tests/models/test_wan_rollout.py::test_sliding_window_with_sink_and_cfg",
    "tests/models/test_wan_rollout.py::test_whole_block_reads_read_the_same_boundary_tokens",
    "tests/paging/test_forward_staging.py::test_kernels_staged_equal_unstaged_bit_for_bit[k8v8]",
    "tests/paging/test_forward_staging.py::test_kernels_staged_equal_unstaged_on_random_geometries",
    "tests/paging/test_forward_staging.py::test_repeated_probe_restages_only_its_chunk",
    "tests/paging/test_forward_staging.py::test_single_row_after_batched_forwards_matches_unstaged",
    "tests/paging/test_geometries.py::test_shipped_geometry",
    "tests/paging/test_machine.py",
    "tests/paging/test_quantized.py::test_batched_branches_share_one_mean_and_keep_their_codes",
    "tests/paging/test_quantized.py::test_forwards_match_the_oracle_over_dequantized_pools",
    "tests/test_end_to_end.py::test_batched_rows_equal_separate_calls",
    "tests/test_end_to_end.py::test_ragged_chunks_over_many_ticks",
    "tests/test_end_to_end.py::test_real_plans_compile_once",
    "tests/test_end_to_end.py::test_shipped_geometry_reduced_heads",
    "tests/test_end_to_end.py::test_staged_and_unstaged_agree",
    "tests/test_notebooks.py::test_notebook_runs_at_small_size_and_writes_its_figures",
)


# The smoke selection, ``python -m pytest -n 2 -m smoke``: the iteration loop, under a minute of
# CPU. One quick test of every kernel path (contiguous, block tiles, two blocks, rows; the TMA
# pair loop, warp-specialized, scores ahead, the PyTorch path), every K/V format (float,
# int8, k8v8, k8v16, keys-major pools), every mask kind (causal, key limits, key gaps,
# spans) and every paging rule (eviction, compaction, the fixed table width, staging, forks,
# shards, batches). Entries are prefixes like ``SLOW``'s; under ``-m smoke`` an entry that
# selects nothing is an error, and files with no entry are not even collected.
SMOKE = (
    "tests/kernels/test_paged_attention.py::test_key_paths_causal_limits_and_gaps[16-16-permuted]",
    "tests/kernels/test_paged_attention.py::test_key_paths_causal_limits_and_gaps[7-16-repeated]",
    "tests/kernels/test_paged_attention.py::test_key_paths_causal_limits_and_gaps[511-256-permuted]",
    "tests/kernels/test_paged_attention.py::test_key_paths_causal_limits_and_gaps[1-16-permuted]",
    "tests/kernels/test_launch_variants.py::test_tma_variant_matches_oracle[block-pairs-B16-N32]",
    "tests/kernels/test_launch_variants.py::test_warp_specialized_variant_matches_oracle[B16-N16-D64]",
    "tests/kernels/test_scores_ahead.py::test_scores_ahead_matches_oracle[block_tiles-B7-N16-D80-tma]",
    "tests/kernels/test_torch_path.py::test_attention",
    "tests/kernels/test_torch_path.py::test_write_and_gather",
    "tests/kernels/test_masks.py::test_spans_across_query_and_key_tiles[B24-per-row-lookup]",
    "tests/kernels/test_paged_attention_quantized.py::test_any_block_size[B7-int8]",
    "tests/kernels/test_paged_attention_quantized.py::test_any_block_size[B24-int8]",
    "tests/kernels/test_quantized_modes.py::test_k8v16_scores_are_exact_int32_sums",
    "tests/kernels/test_k8v8_attention.py::test_k8v8_slot_major_v_and_default_tiles",
    "tests/kernels/test_write_slots.py::test_chunk_starting_mid_block",
    "tests/kernels/test_write_slots_quantized.py::test_chunk_starting_mid_block",
    "tests/kernels/test_write_slots_quantized.py::test_equalized_channels",
    "tests/kernels/test_gather_blocks.py::test_gather_permuted_blocks[2-B7]",
    "tests/kernels/test_gather_blocks_quantized.py::test_stages_what_was_written[2-B7-int8]",
    "tests/kernels/test_fused.py::test_matches_direct_kernel_calls_bit_for_bit[paged]",
    "tests/kernels/test_merge_states.py::test_split_keys_merge_to_attention_over_all[B1560-2parts]",
    "tests/paging/test_eviction.py",
    "tests/paging/test_plan.py",
    "tests/paging/test_staging.py",
    "tests/paging/test_pool.py",
    "tests/paging/test_batch.py",
    "tests/paging/test_config.py",
    "tests/paging/test_forks.py::test_forks_sharing_a_tail_block_in_one_launch_equal_deep_copies",
    "tests/paging/test_forks.py::test_eviction_drops_references_and_the_last_holder_frees",
    "tests/paging/test_shard.py::test_ranks_read_the_single_process_keys_once",
    "tests/paging/test_attention.py::test_kernel_attention_matches_the_oracle_keys[whole-blocks]",
    "tests/paging/test_quantized.py::test_keys_major_cache_attends_as_the_slot_major_one[int8]",
    "tests/test_end_to_end.py::test_block_aligned_chunks_reuse_staging",
)
SMOKE_FILES = frozenset(entry.partition("::")[0] for entry in SMOKE)
REPO = Path(__file__).resolve().parents[1]


def _smoke_only(config: pytest.Config) -> bool:
    return config.getoption("markexpr", "") == "smoke"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m smoke``, skip importing the test files ``SMOKE`` does not name (collecting the
    whole suite costs more CPU than the smoke tests themselves)."""
    if not _smoke_only(config) or not collection_path.name.startswith("test_"):
        return None
    if collection_path.suffix != ".py":
        return None
    path = collection_path.resolve()
    if not path.is_relative_to(REPO) or path.relative_to(REPO).as_posix() in SMOKE_FILES:
        return None
    return True


def is_slow(item: pytest.Item) -> bool:
    """Whether ``item`` is left out of the quick subset: listed in ``SLOW``, or a README block
    that builds a diffusers model (blocks are named by line, which moves as the README does)."""
    if item.nodeid.startswith(SLOW):
        return True
    code = getattr(item, "callspec", None) and item.callspec.params.get("code")
    return item.nodeid.startswith("tests/test_readme.py::") and "diffusers" in str(code or "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow(item):
            item.add_marker(pytest.mark.slow)
        if item.nodeid.startswith(SMOKE):
            item.add_marker(pytest.mark.smoke)
    if _smoke_only(config):
        unmatched = [e for e in SMOKE if not any(i.nodeid.startswith(e) for i in items)]
        if unmatched:
            raise pytest.UsageError(f"SMOKE entries that select no test: {unmatched}")
