"""`quantplan scores`: naming an evaluation set as it is printed."""

from __future__ import annotations

import pytest


def test_scores_text_names_a_set_as_it_is_printed():
    """One text scored at two sizes: `scores --text` takes the label it prints ('TEXT (4,080)'), with or without
    commas or 'positions'; a bare text is the set with most scores; an unknown size lists the sets as accepted."""
    from quantplan.cli.common import CliError
    from quantplan.cli.scores import _score_set, _set_label

    sets = [("builtin:lee.cor", 62), ("builtin:lee.cor", 4080), ("mine.txt", 100)]
    assert _set_label(sets[1]) == "builtin:lee.cor (4,080)"
    assert _score_set(sets, "builtin:lee.cor (4,080)", "m") == sets[1]
    assert _score_set(sets, "builtin:lee.cor (4080 positions)", "m") == sets[1]
    assert _score_set(sets, " builtin:lee.cor(62) ", "m") == sets[0]
    assert _score_set(sets, "builtin:lee.cor", "m") == sets[0]
    assert _score_set(sets, "mine.txt", "m") == sets[2]
    with pytest.raises(CliError) as err:
        _score_set(sets, "builtin:lee.cor (5)", "m")
    assert "'builtin:lee.cor (62)', 'builtin:lee.cor (4,080)', 'mine.txt (100)'" in str(err.value)
