"""Registry contracts: what an estimator or loss needs is checked before a run starts."""
import pytest

from rlloom.algos.advantages import ADVANTAGES
from rlloom.algos.contracts import ALWAYS, ROLE_NEEDS, algo_problems
from rlloom.algos.policy_losses import POLICY_LOSSES
from rlloom.algos.presets import PRESETS
from rlloom.algos.registry import NEEDS, Registry
from rlloom.config import ConfigError, load_config
from rlloom.runtime.executor.preflight import preflight


def cfg(*overrides):
    return load_config(None, ["data.preference_file=pairs.jsonl", *overrides])


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_is_runnable(preset):
    assert algo_problems(cfg(f"algo={preset}")) == []


def test_declared_needs():
    assert ADVANTAGES.needs("gae") == {"critic"}
    assert ADVANTAGES.needs("remax") == {"greedy_baseline"}
    assert POLICY_LOSSES.needs("decoupled_ppo") == {"prox_logp"}
    assert ADVANTAGES.needs("grpo") == POLICY_LOSSES.needs("ppo") == frozenset()


def test_every_need_has_a_provider():
    assert ALWAYS | ROLE_NEEDS.keys() == NEEDS.keys()


def test_gae_without_a_critic_is_refused_naming_key_and_fix():
    with pytest.raises(ConfigError) as err:
        preflight(cfg("algo=grpo", "algo.advantage=gae"), "process")
    msg = str(err.value)
    assert "algo.advantage=gae needs critic" in msg
    assert "preset algo=grpo has no critic role" in msg
    assert "set algo=ppo" in msg
    assert msg.endswith("or set algo.advantage to one without that need: dr_grpo, grpo, "
                        "reinforce_pp, reinforce_pp_baseline, remax, rloo")


def test_needs_the_runtime_provides_are_accepted():
    assert algo_problems(cfg("algo.policy_loss=decoupled_ppo")) == []
    assert algo_problems(cfg("algo.advantage=remax")) == []
    assert algo_problems(cfg("algo=ppo", "algo.policy_loss=decoupled_ppo")) == []


def test_offline_preset_ignores_online_needs():
    # dpo runs no estimator, so gae's critic need does not apply
    assert algo_problems(cfg("algo=dpo", "algo.advantage=gae")) == []


def test_unregistered_name_is_refused_naming_key():
    with pytest.raises(ConfigError, match=r"algo.policy_loss='ppo2' is not registered; choose "
                                          r"one of cispo, decoupled_ppo, gspo, ppo"):
        preflight(cfg("algo.policy_loss=ppo2"), "process")


def test_register_refuses_an_unknown_need():
    with pytest.raises(ValueError, match=r"'f' declares unknown needs \['critc'\]; known needs: "
                                         r"critic"):
        Registry("thing").register("f", needs={"critc"})
