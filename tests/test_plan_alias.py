"""plan.layouts.rollout, the generation layout's old name, still reads as generation."""
import warnings

import pytest

from rlloom.config import ConfigError, load_config
from rlloom.plan import Layout, Plan


def test_the_old_key_reads_as_generation_with_a_warning():
    with pytest.warns(FutureWarning, match="plan.layouts.rollout is now plan.layouts.generation"):
        plan = Plan(layouts={"actor": {"dp": 2}, "rollout": {"tp": 2}})
    assert plan.layouts == {"actor": Layout(dp=2), "generation": Layout(tp=2)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name is quiet
        assert Plan(layouts={"generation": {"tp": 2}}).layouts["generation"].tp == 2


def test_both_names_at_once_are_refused():
    with pytest.raises(ConfigError, match="plan.layouts has both rollout and generation"):
        load_config(None, ["plan.layouts.rollout.tp=2", "plan.layouts.generation.tp=2"])
