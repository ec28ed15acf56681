"""torch's thread count is chosen on purpose: METRALE_NUM_THREADS wins, an OMP_NUM_THREADS the
user set is left to torch, else the cores not busy with other work (at least one)."""

from __future__ import annotations

import pytest

from metrale.errors import MetraleError
from metrale.threads import THREADS_ENV, BadThreadCountError, choose_threads


def test_the_variable_sets_the_count():
    choice = choose_threads({THREADS_ENV: "3", "OMP_NUM_THREADS": "1"}, cores=2, busy=0.0)
    assert choice.threads == 3 and THREADS_ENV in choice.reason


@pytest.mark.parametrize("raw", ["0", "-2", "two", "1.5"])
def test_a_bad_count_is_refused_naming_the_variable(raw):
    with pytest.raises(BadThreadCountError, match=THREADS_ENV):
        choose_threads({THREADS_ENV: raw}, cores=2, busy=0.0)
    assert issubclass(BadThreadCountError, MetraleError)


def test_omp_num_threads_is_left_to_torch():
    assert choose_threads({"OMP_NUM_THREADS": "1"}, cores=8, busy=0.0).threads is None


@pytest.mark.parametrize("cores, busy, want", [
    (2, 0.0, 2),     # idle: every core
    (2, 0.9, 1),     # one core busy elsewhere
    (2, 7.5, 1),     # overloaded: never zero
    (16, 3.2, 13),
    (4, 0.4, 4),
])
def test_free_cores_without_a_setting(cores, busy, want):
    assert choose_threads({}, cores=cores, busy=busy).threads == want


def test_the_real_environment_gives_a_usable_count():
    choice = choose_threads({})
    assert choice.threads is not None and choice.threads >= 1
