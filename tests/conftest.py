"""Shared fixtures: tiny release-layout checkpoints with their HF float32 reference logits."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from .harness import COMPILE_FLAGS, Fixture, build_fixture
from .reference import CONFIGS


def _write_bytecode() -> None:
    """Python writes the bytecode of what this run imports, here and in every process it starts
    (`$PYTHONDONTWRITEBYTECODE` dropped): CI installs with `pip install --no-compile`, since compiling
    every file of torch, transformers and Jupyter ahead costs more than the run's imports, and
    without bytecode written each of the run's processes would compile its imports again."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


def pytest_configure(config) -> None:
    """XLA's quicker compilation (`harness.COMPILE_FLAGS`) for this pytest, its subprocesses,
    notebook kernels and simulated clusters (which keep the caller's XLA flags). One JAX
    compilation cache for this pytest's subprocesses (`harness.subprocess_env`) and simulated
    clusters (`mcjax_setup.sh` reads $MCJAX_JAX_CACHE): a program that one of them compiled is
    read, not compiled again, by the next that runs it (the same mesh in another test, the same
    notebook cells under another numbering). Per run, so nothing stale from an earlier checkout is
    read; removed at exit. The pytest workers read it and write to it too, but only programs that
    took half a second or more to compile: the quick tier's many small ones cost more to write than
    another process saves by reading them."""
    import jax

    _write_bytecode()
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_backend_optimization_level" not in flags:  # the caller's own level wins
        os.environ["XLA_FLAGS"] = " ".join([*COMPILE_FLAGS, flags]).strip()
    if "MCJAX_JAX_CACHE" not in os.environ:
        cache = tempfile.mkdtemp(prefix="dsr1-test-jax-cache-")
        os.environ["MCJAX_JAX_CACHE"] = cache
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", os.environ["MCJAX_JAX_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


# The files that take longest under CI's `-n 2 --dist loadfile` (pytest's `--durations=0`, summed
# per file), longest first. A worker takes the next file when it is nearly done with its own, so
# starting with these leaves short files for the end and the workers finish together; xdist's own
# order (most tests first) would leave these, a test or two each, for last. A file missing here
# only runs after them.
LONGEST_FIRST = (
    "notebooks/main.ipynb", "tests/test_moe.py", "tests/test_v4.py", "tests/test_recovery.py",
    "tests/test_sparse_attention.py", "tests/test_bench.py", "tests/test_server.py", "tests/test_convert.py",
    "tests/test_cluster.py", "notebooks/serve.ipynb", "tests/test_serving.py", "tests/test_serving_mtp.py",
    "tests/test_paged_attention.py", "tests/test_speculative.py", "tests/test_smoke.py", "tests/test_generate.py",
    "tests/test_cpu_kernels.py", "tests/test_draft_numerics.py", "tests/test_disaggregate.py",
    "tests/test_serving_processes.py", "tests/test_server_api.py", "tests/test_plan.py", "tests/test_api.py",
    "tests/test_browser.py", "tests/test_sharding.py", "tests/test_dry_run.py",
)


# Tests that CI's 20 minutes leave to the extended tier, named in one place so that the budget is
# managed here: each repeats, on another variant or at a larger size, what a test kept in CI checks
# (the one kept is named after it), or times a benchmark command whose figures live in docs.
EXTENDED_FOR_TIME = (
    "tests/test_expert_all_to_all.py::test_all_to_all_and_dp_match_psum_and_one_device_on_eight_devices[4-2]",  # moe
    "tests/test_moe.py::test_expert_loop_matches_ragged_dot_on_eight_devices[8-1]",  # [4-2]
    "tests/test_plan.py::test_scaled_down_serving_step_compiled_by_xla_tpu_for_v5e[tp]",  # [dp]
    "tests/test_plan.py::test_scaled_down_plan_compiles_on_eight_fake_devices",  # the v5e step
    "tests/test_paged_attention.py::test_extend_with_the_kernel_equals_the_xla_path[int8]",  # [None]
    "tests/test_bench.py::test_cli_serve_compares_continuous_and_static",
    "tests/test_bench.py::test_shared_prefix_of_2000_tokens_cuts_the_second_time_to_first_token_5x",
    "tests/test_bench.py::test_cli_moe_runs_every_kernel_to_the_same_output",
    "tests/test_bench.py::test_cli_compare_hf",
    "tests/test_bench.py::test_cli_attention_times_every_implementation_against_xlas",
    "tests/test_bench.py::test_cli_prefill_reports_flops_against_the_peak",
    "tests/test_bench_quality.py::test_quality_command_reports_every_variant_and_k",
    "tests/test_bench_quality.py::test_drafts_command_alternates_every_k_in_both_modes",
    "tests/test_convert.py::test_peak_memory_follows_one_layer_not_the_model",  # each process reads its share
    "tests/test_smoke.py::test_single_records_the_machine_and_starts_jupyter_with_mcjax_single",  # test_single_host
    "tests/test_smoke.py::test_single_on_an_accelerator_machine_leaves_the_kernel_its_devices",  # ...naming_the_lock
    "tests/test_api.py::test_large_weights_are_drawn_in_slices_and_int8_stacks_layer_by_layer",
    "tests/test_grouped_matmul.py::test_routed_experts_by_the_kernel_equal_ragged_dot",  # the kernel's own tests
    "tests/test_sparse_attention.py::test_greedy_equals_hf_token_by_token_greedy[v32_grouped_mtp]",  # the other config
    "tests/test_serving_mtp.py::test_greedy_with_drafts_equals_without[2]",  # [1]
    "tests/test_serving_mtp.py::test_no_compilation_after_warm_up",  # test_serving's
    "tests/test_serving.py::test_sixteen_slots_decode_in_narrower_calls_without_compiling",  # ..._during_200_steps
    "tests/test_speculative.py::test_greedy_with_drafts_on_a_mesh",  # test_serving_mtp on eight devices
    "tests/test_speculative.py::test_sampling_with_drafts_follows_the_model",
    "tests/test_speculative.py::test_per_position_verification_is_decode_bit_for_bit_in_bf16[int8]",  # [None]
    "tests/test_sharding.py::test_converted_checkpoint_on_eight_devices_and_two_processes",  # two_processes_two_devices
    "tests/test_sharding.py::test_eight_fake_devices[8-1]",  # [2-4]
    "tests/test_draft_numerics.py::test_engine_bf16_queued",
    "tests/test_lm_eval.py::test_loglikelihood_requests_equal_forward[1]",  # test_server_api's echo logprobs
    "tests/test_vocab_split.py::test_split_vocabulary_samples_the_tokens_of_whole_logits",
    "tests/test_cpu_kernels.py::test_the_avx2_build_computes_the_same[bf16]",
    "tests/test_cpu_kernels.py::test_the_avx2_build_computes_the_same[int8]",
    "tests/test_cpu_kernels.py::test_decode_with_the_kernel_equals_decode_without[bfloat16-int8]",  # the others
    "tests/test_cpu_kernels.py::test_decode_with_the_kernel_equals_decode_without[float32-int8]",
    "tests/test_draft_numerics.py::test_generate_float32_in_the_default_mode",  # test_speculative's one-pass
    "tests/test_draft_numerics.py::test_generate_int8_cache",  # test_generate_bf16
    "tests/test_demo_model.py::test_greedy_with_drafts_equals_greedy_without",  # test_speculative
    "tests/test_lm_eval.py::test_loglikelihood_requests_equal_forward[4]",  # test_server_api's echo logprobs
    "tests/test_disaggregate.py::test_disaggregated_engine_gives_the_mixed_engines_tokens_on_eight_devices[0]",
    "tests/test_profiling.py::test_profile_decode",
    "tests/test_cluster.py::test_hung_initialize_is_cleared_then_initialize_everywhere_works",
    "tests/test_serving_mtp.py::test_perfect_drafter_budgets_and_stop_tokens_in_the_middle_of_drafts",
    "tests/test_smoke.py::test_engines_and_a_notebook_at_jupyters_root_import_the_installed_dsr1",
    "tests/test_generate.py::test_seeded_sampling_is_reproducible_and_row_independent",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """An extended test is a slow one too, so `-m "not slow"` (the quick tier) leaves it out;
    tryfirst: before `-m` selects. `EXTENDED_FOR_TIME` joins the extended tier. The files in
    `LONGEST_FIRST` run first, in its order (each file's tests, and a notebook's cells, keep theirs)."""
    _mark_extended_for_time(items)
    for item in items:
        if item.get_closest_marker("extended") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    root = Path(__file__).parents[1]
    if missing := [path for path in LONGEST_FIRST if not (root / path).exists()]:
        raise pytest.UsageError(f"tests/conftest.py: LONGEST_FIRST names files that do not exist: {missing}")
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
    if config.pluginmanager.hasplugin("xdist"):
        config.option.loadscopereorder = False  # hand out the files in this order


def _mark_extended_for_time(items) -> None:
    """Mark `EXTENDED_FOR_TIME` extended; a name there that its collected file lacks is an error."""
    ids = {item.nodeid for item in items}
    files = {nodeid.split("::")[0] for nodeid in ids}
    if stale := [n for n in EXTENDED_FOR_TIME if n.split("::")[0] in files and n not in ids]:
        raise pytest.UsageError(f"tests/conftest.py: EXTENDED_FOR_TIME names tests that do not exist: {stale}")
    for item in items:
        if item.nodeid in EXTENDED_FOR_TIME:
            item.add_marker(pytest.mark.extended)


@pytest.fixture(scope="session")
def all_fixtures(tmp_path_factory) -> dict[str, Fixture]:
    """Every reference variant, built once per pytest run; the R1-like one carries an MTP layer."""
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build_fixture(root, name, mtp=name == "grouped_qlora") for name in sorted(CONFIGS)}


@pytest.fixture(params=sorted(CONFIGS))
def fixture(request, all_fixtures) -> Fixture:
    return all_fixtures[request.param]


@pytest.fixture
def grouped(all_fixtures) -> Fixture:
    """The R1-like variant: group-limited routing, q_lora, odd head dims, MTP layer in the folder."""
    return all_fixtures["grouped_qlora"]


@pytest.fixture(params=[True, False], ids=["kernel", "xla"])
def cpu_kernel(request, monkeypatch) -> bool:
    """Run a test with dsr1's CPU decode kernel (skipped where it is not built) and without it
    (`DSR1_CPU_KERNELS=0`: XLA's own products)."""
    from dsr1.cpu import ffi as cpu_kernels

    if request.param and not cpu_kernels.available():
        pytest.skip("dsr1's CPU kernel is not built on this machine (no C++ compiler, or no AVX2)")
    monkeypatch.setenv("DSR1_CPU_KERNELS", "1" if request.param else "0")
    return request.param
