"""Root pytest configuration.

Triton kernels run under the interpreter when no CUDA GPU is present; the variable must
be set before any kernel module is imported, so it is set here, first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The Python blocks of README.md and docs/*.md, run as written (scripts/test.sh names those files).
from tests.docs.markdown_examples import pytest_collect_file  # noqa: E402, F401


def pytest_addoption(parser):
    parser.addoption(
        "--failures-now",
        action="store_true",
        help="print each failure's traceback the moment it happens (with pytest-xdist too), not only at the end",
    )


def _runs_on_gpu(item) -> bool:
    """Whether a test exercises a GPU path when one is present: the GPU tier (``-m gpu``).

    A test is in the tier when it needs CUDA (a skip mark whose reason names CUDA), lives in a
    Triton backend's module, or names CUDA, Triton or the GPU in its name or parameters.
    """
    if "triton" in item.path.name or item.path.suffix == ".md":  # the docs' blocks: their CUDA ones run there
        return True
    if any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
        return True
    name = item.name.lower()
    return any(word in name for word in ("cuda", "triton", "gpu"))


# The tests left out of the development tier (``-m "not slow"``, scripts/test_fast.sh), by file
# (every test in it) or by test function (every parametrization): each took 5 s or more on the
# 2-core VM under load (`--durations`), or runs a notebook, builds a wheel or starts a server.
# CI runs them all. A function named here that its file (when collected) lacks is an error.
SLOW = (
    "tests/distributed/test_rank_checks.py::test_a_late_rank_is_waited_for_and_the_wait_is_stated",
    "tests/distributed/test_rank_checks.py::test_a_rank_that_leaves_process_group_out_is_found_within_seconds",
    "tests/kernels/test_anisotropic.py::test_reference_matches_gemmi_on_a_large_synthetic_anisotropic_3wip",
    "tests/kernels/test_bad_kernel_inputs.py::test_reference_splat_peak_within_its_check",
    "tests/kernels/test_bad_kernel_inputs.py::test_symmetrize_peak_within_its_stated_bound",
    "tests/kernels/test_check_processes.py",
    "tests/kernels/test_compile_and_graphs.py::test_compiled_loop_matches_eager_cpu_backend",
    "tests/kernels/test_density_aniso_triton.py::test_gpu_tiles_one_atom_per_program",
    "tests/kernels/test_density_aniso_triton.py::test_real_structures_match_reference",
    "tests/kernels/test_density_cpu.py::test_kernel_in_a_forked_child_after_the_helpers_started",
    "tests/kernels/test_density_cpu.py::test_no_openmp_build_gives_identical_maps",
    "tests/kernels/test_density_deterministic.py::test_anisotropic_matches_reference_and_ignores_atom_order",
    "tests/kernels/test_density_deterministic.py::test_deterministic_kernels_compile_for_sm90_without_a_gpu",
    "tests/kernels/test_density_deterministic.py::test_ensemble_matches_reference_and_ignores_atom_order",
    "tests/kernels/test_density_deterministic.py::test_frames_match_reference_and_ignore_atom_order",
    "tests/kernels/test_density_deterministic.py::test_isotropic_matches_reference_and_ignores_atom_order",
    "tests/kernels/test_density_deterministic.py::test_sphere_larger_than_the_cell",
    "tests/kernels/test_density_triton.py::test_1orc_matches_reference",
    "tests/kernels/test_density_triton.py::test_device_radius_rule_matches_cutoff_radius",
    "tests/kernels/test_density_triton.py::test_frames_equal_single_splats_forward_and_gradients",
    "tests/kernels/test_density_triton.py::test_row_spans_keep_every_voxel_of_a_small_sphere",
    "tests/kernels/test_density_triton.py::test_tiny_cell_sphere_larger_than_cell",
    "tests/kernels/test_density_triton.py::test_vec_and_scalar_paths_sphere_larger_than_cell",
    "tests/kernels/test_density_triton.py::test_vec_path_one_atom_per_program",
    "tests/kernels/test_ensemble.py::test_reference_gradcheck",
    "tests/kernels/test_ensemble_inputs.py::test_a_sum_over_a_million_atom_frames_stays_within_its_chunk",
    "tests/kernels/test_ensemble_inputs.py::test_a_sum_whose_gradient_state_cannot_fit_is_refused_before_allocation",
    "tests/kernels/test_ensemble_inputs.py::test_the_warning_counts_exactly_the_atoms_whose_radius_is_below_the_spacing",
    "tests/kernels/test_launched_in_background.py",
    "tests/kernels/test_loop.py::test_fit_from_a_distorted_start_comes_back_to_the_model",
    "tests/kernels/test_model_file_limits.py::test_gzip_of_1_5_gb_of_blank_lines_is_refused_in_bounded_memory",
    "tests/kernels/test_model_file_limits.py::test_gzip_that_passes_max_bytes_is_refused_before_it_is_held",
    "tests/kernels/test_model_file_limits.py::test_sparse_3_gb_file_of_nul_bytes_named_pdb_is_refused_at_its_first_block",
    "tests/kernels/test_reciprocal.py::test_every_shell_to_2A_within_1e_3_of_gemmis_exact_factors",
    "tests/kernels/test_reciprocal.py::test_sampling_blur_is_gemmis_refmac_compatible_blur",
    "tests/kernels/test_reciprocal.py::test_triton_map_gives_gemmis_factors",
    "tests/kernels/test_reciprocal.py::test_without_blur_aliasing_grows_towards_d_min_but_stays_below_1e_2",
    "tests/kernels/test_reciprocal.py::test_without_blur_sharp_anisotropic_atoms_alias",
    "tests/kernels/test_reference_density.py::test_box_grid_matches_the_whole_cell_map",
    "tests/kernels/test_reference_density.py::test_electron_count_and_empty_atom_set",
    "tests/kernels/test_reference_density.py::test_reference_matches_gemmi",
    "tests/kernels/test_reference_density.py::test_symmetrize_matches_gemmi_put_model_density",
    "tests/kernels/test_register_backend.py::test_a_correct_user_kernel_passes_every_check_including_a_fresh_first_call",
    "tests/kernels/test_register_backend.py::test_a_kernel_no_new_process_can_import_is_skipped_with_the_reason_and_does_not_fail",
    "tests/kernels/test_register_backend.py::test_a_kernel_raising_keyboard_interrupt_stops_the_whole_check",
    "tests/kernels/test_register_backend.py::test_a_kernel_that_closes_stdout_and_stderr_still_passes_and_the_caller_keeps_them",
    "tests/kernels/test_register_backend.py::test_a_kernel_that_ends_or_kills_its_process_fails_runs_in_the_isolated_check",
    "tests/kernels/test_register_backend.py::test_a_kernel_that_exits_in_the_first_call_process_fails_first_call",
    "tests/kernels/test_register_backend.py::test_a_kernel_that_never_returns_fails_at_the_timeout_naming_the_check",
    "tests/kernels/test_register_backend.py::test_a_meta_device_kernel_ends_in_a_report",
    "tests/kernels/test_register_backend.py::test_a_single_model_or_path_is_one_structure",
    "tests/kernels/test_register_backend.py::test_a_single_structure_string_is_one_structure_not_its_characters",
    "tests/kernels/test_register_backend.py::test_a_timeout_in_the_first_call_check_stops_its_new_process_too",
    "tests/kernels/test_register_backend.py::test_classic_bugs_fail_the_right_check",
    "tests/kernels/test_register_backend.py::test_first_call_garbage_of_a_triton_kernel_is_found_in_a_fresh_process",
    "tests/kernels/test_register_backend.py::test_our_backends_pass_every_check",
    "tests/kernels/test_register_backend.py::test_our_cpu_backend_passes_against_gemmi_on_a_bundled_structure",
    "tests/kernels/test_register_backend.py::test_progress_names_each_check_as_it_starts_in_order",
    "tests/kernels/test_register_backend.py::test_report_renders_a_table_and_saves_a_self_contained_page_with_the_worst_section",
    "tests/kernels/test_register_backend.py::test_truncated_radius_is_located_at_the_edge_of_an_atoms_sphere",
    "tests/kernels/test_register_backend.py::test_wrong_gradient_sign_is_found_by_finite_differences_too_and_named_by_component",
    "tests/kernels/test_tricubic.py::test_fast_paths_match_reference",
    "tests/kernels/test_tricubic.py::test_gradcheck_float64",
    "tests/kernels/test_tricubic.py::test_lagrange_matches_scalar_neville",
    "tests/kernels/test_write_signals.py::test_a_signal_that_does_not_end_the_process_leaves_the_write_alone",
    "tests/notebooks/test_cli.py::test_lab_serves_the_quickstart_with_token_auth",
    "tests/notebooks/test_cli_launch.py",
    "tests/notebooks/test_cli_sf.py",
    "tests/notebooks/test_notebooks.py::test_benchmarks_notebook_plots_the_latest_record_and_picks_up_torchref",
    "tests/notebooks/test_notebooks.py::test_debugging_notebook_on_a_gpu_checks_triton_in_a_fresh_process",
    "tests/notebooks/test_notebooks.py::test_debugging_notebook_without_a_gpu_says_so_and_shows_the_recorded_h100_run",
    "tests/notebooks/test_notebooks.py::test_notebook_runs",
    "tests/notebooks/test_lab_startup_output.py::test_headless_lab_says_no_browser_once_and_prints_no_deprecation_warning",
    "tests/packaging/test_packaging.py::test_an_edit_rebuilds_its_translation_units_and_their_modules_only",
    "tests/packaging/test_packaging.py::test_configuring_again_compiles_nothing",
    "tests/packaging/test_packaging.py::test_sdist_holds_the_sources_and_no_build_output",
    "tests/packaging/test_packaging.py::test_wheel_metadata_version_and_licence",
    "tests/packaging/test_packaging.py::test_wheel_ships_every_cpp_source_and_its_compiled_module",
    "tests/packaging/test_packaging.py::test_wheel_ships_every_notebook",
    "tests/workbench/test_check_cli.py::test_a_buggy_kernel_exits_1_and_says_which_check_failed",
    "tests/workbench/test_check_cli.py::test_a_correct_kernel_exits_0_and_writes_the_page",
    "tests/workbench/test_check_cli.py::test_a_hanging_kernel_fails_at_the_timeout",
    "tests/workbench/test_check_cli.py::test_a_kernel_that_exits_kills_itself_or_returns_no_data_exits_1_with_a_report",
    "tests/workbench/test_check_cli.py::test_ctrl_c_during_a_hanging_kernel_exits_130_and_leaves_no_process",
    "tests/workbench/test_resolution.py::test_a_comparison_adds_its_fsc",
    "tests/workbench/test_resolution.py::test_the_errors_follow_radius_and_blur",
)


def _slow_name(item) -> str | None:
    """The entry of :data:`SLOW` that names ``item`` (its file, or its file and function), or None."""
    file, _, rest = item.nodeid.partition("::")
    function = rest.split("[", 1)[0]
    for name in (f"{file}::{function}", file):
        if name in _SLOW:
            return name
    return None


_SLOW = frozenset(SLOW)


def pytest_collection_modifyitems(config, items):
    import pytest

    modules = {}
    for item in items:
        if _runs_on_gpu(item):
            item.add_marker(pytest.mark.gpu)
        if _slow_name(item) is not None:
            item.add_marker(pytest.mark.slow)
        if getattr(item, "module", None) is not None:
            modules[item.nodeid.partition("::")[0]] = item.module
    stale = []
    for name in SLOW:
        file, _, function = name.partition("::")
        if file in modules and function and not hasattr(modules[file], function):
            stale.append(name)
    if stale:
        raise pytest.UsageError(f"conftest.SLOW names tests that no longer exist (rename or remove them): {stale}")
    # Longest files first: pytest-xdist hands files to its workers in this order, and a long file handed out
    # last leaves the other workers idle while it runs (the sdist and wheel build alone takes minutes on 2 cores).
    slow_files = {item.nodeid.partition("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: _start_rank(item.nodeid.partition("::")[0], slow_files))


def _start_rank(file: str, slow_files: set[str]) -> int:
    """0 for the file that builds a wheel, 1 for files holding a slow test, 2 for the rest (a stable sort key)."""
    if file == "tests/packaging/test_packaging.py":
        return 0
    return 1 if file in slow_files else 2


_config = None


def pytest_configure(config):
    global _config
    _config = config


def pytest_runtest_logreport(report):
    if _config is None or not _config.getoption("--failures-now") or not report.failed:
        return
    terminal = _config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None:
        terminal.write_line("")
        terminal.write_sep("!", f"FAILED {report.nodeid} ({report.when})", red=True)
        terminal.write_line(str(report.longrepr))
