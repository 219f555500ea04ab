"""The checks every layer shares, split by what they check: :mod:`~jagg.checks.values` (numbers, counts, seeds,
dtypes, command-line numbers), :mod:`~jagg.checks.specs` (``NAME:KEY=VALUE`` specs and repeated names),
:mod:`~jagg.checks.files` (files written and JSON files read) and :mod:`~jagg.checks.sampling` (a rollout's settings).
Every name is importable from ``jagg.checks``."""

from .files import (check_fields, check_json_files, check_output_file, expected, has_kind, json_kind, parse_json,
                    read_json, read_json_lines)
from .sampling import (ARGUMENTS, REDUCTIONS, SDE_TYPES, SDE_WINDOW_SCHEDULES, Keys, check_eta, check_group_size,
                       check_noise, check_reduction, check_sampler, check_sde_steps, check_sde_type,
                       check_sde_window_schedule, check_sigmas, check_sliding_window, check_train_steps,
                       cps_last_step_error)
from .specs import check_no_repeats, check_unique_names, parse_spec
from .values import (FLOAT32_MAX, FLOAT32_TINY, INT64_MAX, INT64_MIN, MAX_THREADS, SEED_MAX, as_increasing_steps,
                     as_steps, as_vector, check_callable, check_count, check_finite_tensor, check_flag, check_float32,
                     check_int64, check_number, check_positive, check_probabilities,
                     check_seed, check_tensor, check_threads, first_non_finite, is_finite_number, number_arg,
                     parse_number, shown)
