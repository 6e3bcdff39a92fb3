"""An N:M pattern in a recipe is checked at load time by the rule dal.sparsity applies.

The oracle for "supported" is what dal.sparsity actually does: a pattern a recipe accepts must
make masks that keep exactly the N largest |w| of every group of M (computed here with numpy),
and one the recipe refuses must be refused by prepare_sparse as well. A refused pattern is
reported at load with file, line and key, not later inside prepare.
"""
import textwrap

import numpy as np
import pytest

from dal.recipe import RecipeError, load_recipe

PATTERNS = ["1:2", "2:4", "1:4", "4:8", "3:7", "8:16", "15:16", " 2 : 4 ",
            "1:32", "16:32", "0:4", "4:4", "4:2", "2:4:8", "dense", "2/4", "²:4", ""]
#: written out from the documented rule (ASCII digits, spaces allowed, 1 <= N < M <= 16), not from
#: the parser: the recipe and dal.sparsity share that parser, so agreeing with each other proves little
VALID = {"1:2", "2:4", "1:4", "4:8", "3:7", "8:16", "15:16", " 2 : 4 "}


def write(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def loads(pattern):
    try:
        rule = load_recipe({"rules": [{"match": "*", "sparsity": pattern}]}).rules[0]
    except RecipeError as e:
        (p,) = e.problems
        assert p.key == "rules[0].sparsity" and "N:M" in p.message
        return None
    return rule.sparsity


def top_n_mask(w: np.ndarray, n: int, m: int) -> np.ndarray:
    """Keep the n largest |w| of each group of m consecutive inputs (rows of a Linear weight)."""
    groups = np.abs(w).reshape(w.shape[0], -1, m)
    order = np.argsort(-groups, axis=-1, kind="stable")
    keep = np.zeros_like(groups, dtype=bool)
    np.put_along_axis(keep, order[..., :n], True, axis=-1)
    return keep.reshape(w.shape)


@pytest.mark.parametrize("pattern", PATTERNS, ids=[repr(p) for p in PATTERNS])
def test_recipe_accepts_exactly_what_sparsity_can_do(pattern):
    torch = pytest.importorskip("torch")
    from dal.sparsity import prepare_sparse

    accepted = loads(pattern)
    assert (accepted is not None) == (pattern in VALID), pattern
    lin = torch.nn.Linear(7 * 16 * 2, 3)  # in_features: a multiple of every M accepted above
    with torch.no_grad():
        lin.weight.copy_(torch.randn(3, 7 * 16 * 2, generator=torch.Generator().manual_seed(0)))
    dense = lin.weight.detach().numpy().copy()
    try:
        prepare_sparse(torch.nn.Sequential(lin), pattern=pattern)
    except (ValueError, TypeError):
        assert accepted is None, f"recipe accepted {pattern!r}, which dal.sparsity refuses"
        return
    assert accepted is not None, f"recipe refused {pattern!r}, which dal.sparsity applies"
    n, m = (int(x) for x in accepted.split(":"))
    assert accepted == f"{n}:{m}"  # stored canonical, compared as text with hardware models
    np.testing.assert_array_equal(lin.weight_mask.numpy().astype(bool), top_n_mask(dense, n, m))


def test_unsupported_pattern_fails_at_load_with_file_line_and_key(tmp_path):
    path = write(tmp_path, """\
        hardware: a2000
        rules:
          - type: conv
            weight: int8
            sparsity: "1:32"
        """)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    (p,) = err.value.problems
    assert (p.source, p.line, p.key) == (str(path), 5, "rules[0].sparsity")
    assert f"{path}:5: rules[0].sparsity:" in str(err.value)
    assert "'1:32'" in p.message and "16" in p.message and "2:4" in p.message


def test_unquoted_pattern_is_a_base60_number_and_the_error_says_quote_it(tmp_path):
    path = write(tmp_path, "rules:\n  - type: linear\n    weight: int8\n    sparsity: 2:4\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    (p,) = err.value.problems
    assert p.line == 4 and p.key == "rules[0].sparsity"
    assert "124" in p.message and "quotes" in p.message


def test_pattern_with_spaces_matches_the_hardware_pattern():
    r = load_recipe({"hardware": "a2000", "rules": [{"type": "conv", "weight": "int8", "sparsity": " 2 : 4"}]})
    assert r.rules[0].sparsity == "2:4"
    assert r.resolve_checked("features.0", "Conv2d", "conv").sparsity == "2:4"  # a2000 takes 2:4 on conv
