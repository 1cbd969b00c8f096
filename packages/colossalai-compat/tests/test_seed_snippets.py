"""Every seed snippet that uses ColossalAI's names imports them through colossalai-compat.

The snippets are not run here (they download datasets and want GPUs); each ``colossalai``
name they import or use is resolved through the compat package. A name Colossal does not
serve yet makes its snippet xfail with the compat package's message as the reason; any other
error (a crash inside the compat package or a target) fails the test.
"""

from __future__ import annotations

import pytest
from seed_snippets import NOT_SERVED, check, seeds_dir, snippets, summary

if seeds_dir() is None:
    pytest.skip("../shared/seeds (the seed documents) is not there", allow_module_level=True)

SNIPPETS = [s for s in snippets()[0] if s.era != "none"]


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"{s.era}-{s.id}" for s in SNIPPETS])
def test_snippet_names_resolve(snippet) -> None:
    unresolved = check(snippet)
    for name, error in unresolved.items():
        # the compat package's own messages only: anything else is a bug, not a missing name
        assert error.startswith(NOT_SERVED), (name, error)
    if unresolved:
        reasons = "; ".join(f"{n}: {e}" for n, e in sorted(unresolved.items()))
        pytest.xfail(f"{len(unresolved)} name(s) not served yet: {reasons}")
    if not snippet.parseable:
        pytest.skip(f"{snippet.parse}; its {len(snippet.refs)} colossalai name(s) resolve")


def test_known_snippets_are_found_and_resolved() -> None:
    by_id = {s.id: s for s in snippets()[0]}
    booster = by_id["booster_api:48"]  # the Booster API page's example
    assert booster.era == "booster" and booster.parse == "as written"
    assert {r.dotted for r in booster.refs} >= {
        "colossalai",
        "colossalai.booster.Booster",
        "colossalai.booster.plugin.TorchDDPPlugin",
        "colossalai.launch",
    }
    assert check(booster) == {}
    counts = summary()
    assert counts["python blocks found"] > counts["unique"] > 0
    parsed = sum(counts[k] for k in ("parse as written", "parse reindented"))
    parsed += counts["parse with placeholders"] + counts["unparseable"]
    assert parsed == counts["unique"]
