"""The Pareto dynamic programme finds the exact optimum: checked against brute force."""
import itertools
import math
import random

import pytest

from dal.cost.solve import Option, pareto_front, solve


def _brute(groups, lat_b, size_b, base=0.0):
    best = None
    for picks in itertools.product(*[range(len(g)) for g in groups]):
        lat = base + sum(groups[i][p].latency for i, p in enumerate(picks))
        size = sum(groups[i][p].size for i, p in enumerate(picks))
        score = sum(groups[i][p].score for i, p in enumerate(picks))
        if lat <= lat_b and size <= size_b and (best is None or score < best - 1e-12):
            best = score
    return best


@pytest.mark.parametrize("seed", range(30))
def test_matches_brute_force(seed):
    rnd = random.Random(seed)
    groups = [[Option(f"o{j}", rnd.uniform(1, 10), rnd.uniform(0, 5), rnd.uniform(0, 3)) for j in range(rnd.randint(1, 4))]
              for _ in range(rnd.randint(1, 6))]
    least = sum(min(o.latency for o in g) for g in groups)
    most = sum(max(o.latency for o in g) for g in groups)
    lat_b = rnd.uniform(least * 0.9, most)
    size_b = rnd.choice([math.inf, rnd.uniform(0, 5 * len(groups))])
    best, front = solve(groups, lat_b, size_b, 2.0)
    expected = _brute(groups, lat_b - 2.0, size_b)
    if expected is None:
        assert best is None
    else:
        assert best is not None and best[2] == pytest.approx(expected)
        assert best[0] <= lat_b and best[1] <= size_b


def test_front_is_non_dominated_and_picks_add_up():
    rnd = random.Random(1)
    groups = [[Option(f"o{j}", rnd.uniform(1, 10), 0, rnd.uniform(0, 3)) for j in range(4)] for _ in range(8)]
    front = pareto_front(groups)
    for lat, size, score, picks in front:
        assert lat == pytest.approx(sum(groups[i][p].latency for i, p in enumerate(picks)))
        assert score == pytest.approx(sum(groups[i][p].score for i, p in enumerate(picks)))
        assert not any(l2 <= lat and s2 <= score and (l2, s2) != (lat, score) for l2, _, s2, _ in front)
