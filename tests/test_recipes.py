"""The recipes users copy (recipes/*.yaml, written by `rlloom plan --rehearse`): each a
config `rlloom train` accepts, whose actor training the rehearsal runs again here and finds as
the file records it: the same peak per device, priced within 10%, and a training group that
fits the device."""
import re
from pathlib import Path

import pytest

from rlloom.config import load_config
from rlloom.perf.model.hardware import GIB, hardware
from rlloom.perf.model.memory import USABLE
from rlloom.perf.model.shapes import model_shape
from rlloom.rehearsal.train import rehearse_training

RECIPES = Path(__file__).parents[1] / "recipes"
HEADER = re.compile(r"# rlloom plan: (\S+) (\S+) on (\d+) x (\S+), ")
REHEARSED = re.compile(r"# rehearsed: actor training peak ([\d.]+) GiB per device \(priced "
                       r"([\d.]+)\) for (\d+) rows of (\d+) \+ (\d+) tokens, training group "
                       r"peak ([\d.]+) GiB")


def test_there_are_the_recipes_the_readme_lists():
    listed = set(re.findall(r"\(([\w.-]+\.yaml)\)", (RECIPES / "README.md").read_text()))
    assert listed == {p.name for p in RECIPES.glob("*.yaml")} and len(listed) >= 5


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_a_recipe_is_a_run_config_that_fits_as_rehearsed(path: Path) -> None:
    first, second = path.read_text().splitlines()[:2]
    model, algo, _, device = HEADER.match(first).groups()
    peak, priced, rows, prompt, response, group = REHEARSED.match(second).groups()
    cfg = load_config(path)
    assert cfg.algo.name == algo
    r = rehearse_training(model_shape(model), cfg.plan.layout("actor"), int(rows),
                          int(prompt), int(response), cfg.lora_rank)
    assert r.peak / GIB == pytest.approx(float(peak), abs=0.01)
    assert float(priced) == pytest.approx(float(peak), rel=0.10)
    assert float(group) <= hardware(device).mem_gib * USABLE
